//! Ctrl-C for long commands that write files (`convert`). The handler only
//! raises a flag; the work checks it between chunks and returns
//! [`Interrupted`], so the ordinary error path runs: the temporary file is
//! removed by its guard, the target is untouched, and `main` exits with
//! [`EXIT_ON_SIGINT`]. Exiting from the handler instead would skip that
//! cleanup. (Chat has its own handler, `chat::interrupt`; a process
//! installs one or the other.)

use anyhow::{Context, Result};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

/// The exit status of a program ended by SIGINT, by shell convention.
pub const EXIT_ON_SIGINT: u8 = 130;

static RAISED: AtomicBool = AtomicBool::new(false);

/// The error returned by work stopped by Ctrl-C; `main` recognizes it.
#[derive(Debug, thiserror::Error)]
#[error("interrupted (Ctrl-C); nothing was written")]
pub struct Interrupted;

/// Installs the process-wide Ctrl-C handler that raises the flag (once per
/// process; later calls return the first call's outcome). A second Ctrl-C
/// ends the process at once, for work stuck where it does not check (a
/// slow disk); its temporary is then removed by the next run.
pub fn install_ctrl_c_flag() -> Result<()> {
    static INSTALLED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    INSTALLED
        .get_or_init(|| {
            ctrlc::set_handler(|| {
                if RAISED.swap(true, Ordering::SeqCst) {
                    std::process::exit(i32::from(EXIT_ON_SIGINT));
                }
            })
            .map_err(|e| e.to_string())
        })
        .clone()
        .map_err(anyhow::Error::msg)
        .context("cannot install the Ctrl-C handler")
}

/// `Err(Interrupted)` once Ctrl-C was pressed.
pub fn check() -> std::result::Result<(), Interrupted> {
    if RAISED.load(Ordering::SeqCst) {
        Err(Interrupted)
    } else {
        Ok(())
    }
}

/// Whether `e` (or anything it wraps) is an [`Interrupted`].
pub fn is_interrupted(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.is::<Interrupted>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interrupted_is_found_under_context() {
        let e = anyhow::Error::new(Interrupted).context("convert: out.gguf");
        assert!(is_interrupted(&e));
        assert!(!is_interrupted(&anyhow::anyhow!("disk full")));
    }
}
