//! Connections: accepting them (at most `--max-connections` open at once),
//! HTTP/1.1 on each (hyper), and the time limits that keep a slow or
//! silent client from holding a connection forever. The request body's
//! limit (`--read-timeout`) is applied where the body is read
//! (`http::guard`).

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio::time::Sleep;

#[derive(Clone, Copy, Debug)]
pub struct ConnectionLimits {
    /// Connections open at once; further ones wait in the listen backlog.
    pub max_connections: usize,
    /// A request's head (request line and headers) must arrive within
    /// this, counted from when the connection opens or its previous reply
    /// was sent: it closes slowloris clients and idle kept-alive
    /// connections alike (hyper has one timer for both).
    pub header_timeout: Duration,
    /// A write to the client that makes no progress for this long closes
    /// the connection (a client that stops reading).
    pub write_timeout: Duration,
}

/// Serves `router` (the one `current` holds when a request arrives: the
/// server answers "loading" until the model is ready) on every accepted
/// connection until `shutdown` completes, then lets the open connections
/// finish their requests and returns when the last one closed.
pub async fn serve(
    listener: TcpListener,
    current: watch::Receiver<Router>,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()>,
) {
    let max = limits
        .max_connections
        .clamp(1, Semaphore::MAX_PERMITS.min(u32::MAX as usize));
    let places = Arc::new(Semaphore::new(max));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    tokio::pin!(shutdown);
    loop {
        // A place first: past the cap, connections wait unaccepted.
        let place = tokio::select! {
            () = &mut shutdown => break,
            place = places.clone().acquire_owned() => match place {
                Ok(place) => place,
                Err(_) => break,
            },
        };
        let stream = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    accept_failed(&e).await;
                    continue;
                }
            },
        };
        // A stream is many small writes (an SSE event per token). With
        // Nagle's algorithm on, an event written while the one before is
        // still unacknowledged waits for that ACK, which a client delays by
        // up to 40 ms: on a kept-alive connection time to first token was
        // 40-44 ms where a fresh connection's was 8-11 ms (and the official
        // Python client's 26-30). Latency is what a token stream is for.
        if let Err(e) = stream.set_nodelay(true) {
            eprintln!(
                "pulsar serve: cannot set TCP_NODELAY on a connection ({e}); serving it anyway"
            );
        }
        let io = TokioIo::new(WriteDeadline::new(stream, limits.write_timeout));
        let routes = current.clone();
        let service = hyper::service::service_fn(move |req| {
            let router = routes.borrow().clone();
            tower::ServiceExt::oneshot(router, req)
        });
        let connection = http.serve_connection(io, service);
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            let _place = place;
            tokio::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => return,
                _ = stop.wait_for(|stop| *stop) => {}
            }
            // Shutting down: the request in flight finishes, then the
            // connection closes.
            connection.as_mut().graceful_shutdown();
            let _ = connection.await;
        });
    }
    let _ = stop_tx.send(true);
    // Each connection gives its place back as it closes.
    let _ = places.acquire_many(max as u32).await;
}

/// An accept that failed: a client that left before it was accepted is
/// nothing; anything else (out of file descriptors) is said and waited
/// out, rather than spun on.
async fn accept_failed(e: &io::Error) {
    use io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        e.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        return;
    }
    eprintln!("pulsar serve: cannot accept a connection ({e}); retrying in 1 s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

/// A connection whose writes fail once one has made no progress for
/// `limit`: hyper has no write timeout, and a client that stops reading
/// would otherwise hold its connection (and what waits in its send
/// buffer) forever.
struct WriteDeadline {
    io: TcpStream,
    limit: Duration,
    /// Running while a write (or flush) waits for the client.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl WriteDeadline {
    fn new(io: TcpStream, limit: Duration) -> WriteDeadline {
        WriteDeadline {
            io,
            limit,
            stalled: None,
        }
    }

    /// After a write that could not go on: pending until `limit` has
    /// passed since the first such write, then an error.
    fn wait<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let limit = self.limit;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        ready!(timer.as_mut().poll(cx));
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "the client read nothing for {} s (--write-timeout)",
                limit.as_secs()
            ),
        )))
    }

    /// A write's result: progress stops the timer, none starts it.
    fn progress<T>(
        &mut self,
        cx: &mut Context<'_>,
        result: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        match result {
            Poll::Pending => self.wait(cx),
            done => {
                self.stalled = None;
                done
            }
        }
    }
}

impl AsyncRead for WriteDeadline {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl AsyncWrite for WriteDeadline {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.io).poll_write(cx, buf);
        this.progress(cx, result)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.progress(cx, result)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.io).poll_flush(cx);
        this.progress(cx, result)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.io).poll_shutdown(cx);
        this.progress(cx, result)
    }
}
