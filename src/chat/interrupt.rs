//! Ctrl-C. During a reply it stops that reply (the generation loop reads
//! the flag before every token); pressed again before the reply has
//! stopped (say, during a long prefill) it ends the program. Outside a
//! reply it ends the program: at a terminal prompt the line editor sees
//! Ctrl-C as a key instead, so this only happens while reading piped input
//! or between replies.

use anyhow::{Context, Result};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// The exit status of a program ended by SIGINT, by shell convention.
const EXIT_ON_SIGINT: i32 = 130;

#[derive(Clone)]
pub struct Interrupt {
    replying: Arc<AtomicBool>,
    raised: Arc<AtomicBool>,
}

impl Interrupt {
    /// Installs the process-wide Ctrl-C handler; call once.
    pub fn install() -> Result<Interrupt> {
        let me = Interrupt {
            replying: Arc::new(AtomicBool::new(false)),
            raised: Arc::new(AtomicBool::new(false)),
        };
        let handler = me.clone();
        ctrlc::set_handler(move || handler.on_ctrl_c())
            .context("cannot install the Ctrl-C handler")?;
        Ok(me)
    }

    fn on_ctrl_c(&self) {
        if self.replying.load(Ordering::SeqCst) && !self.raised.swap(true, Ordering::SeqCst) {
            return;
        }
        // Not replying, or a second Ctrl-C: leave now. Replies are flushed
        // as they stream, so no text is lost.
        eprintln!();
        std::process::exit(EXIT_ON_SIGINT);
    }

    /// Marks the start of a reply; Ctrl-C now stops the reply.
    pub fn begin_reply(&self) {
        self.raised.store(false, Ordering::SeqCst);
        self.replying.store(true, Ordering::SeqCst);
    }

    /// Marks the end of a reply; returns whether Ctrl-C stopped it.
    pub fn end_reply(&self) -> bool {
        self.replying.store(false, Ordering::SeqCst);
        self.raised.swap(false, Ordering::SeqCst)
    }

    /// Whether Ctrl-C was pressed during the current reply.
    pub fn raised(&self) -> bool {
        self.raised.load(Ordering::SeqCst)
    }
}
