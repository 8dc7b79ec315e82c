//! Files that appear whole or not at all.
//!
//! Everything Pulsar writes goes first to a temporary file beside its
//! target (`.{name}.pulsar-tmp-{pid}-{n}`, same folder so the final rename
//! never crosses filesystems), is fsynced, renamed over the target, and the
//! folder is fsynced so the rename itself survives a power cut. Until the
//! rename the target is untouched; if anything fails — an I/O error, an
//! early return, a panic — the guard's `Drop` removes the temporary. A
//! process killed outright (SIGKILL, a crash) cannot run `Drop`, so the
//! next `AtomicFile` created in the same folder removes the temporaries of
//! processes that no longer exist.
//!
//! This module sits at the top of the crate, below `model/` and
//! `commands/`, so that every layer can use it.

use anyhow::{Context, Result, anyhow, bail};
use std::ffi::OsStr;
use std::fs::File;
use std::io::{BufWriter, ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The marker between the target's name and the owner's pid. Specific to
/// Pulsar so that the folder-wide cleanup never mistakes another program's
/// temporary (many use `.tmp`) for one of ours.
const TEMP_MARKER: &str = ".pulsar-tmp-";

/// Large enough that writes reach the kernel in big pieces; small enough
/// that a Ctrl-C check between chunks by the caller stays prompt.
const BUFFER_BYTES: usize = 1 << 22;

/// Distinguishes the temporaries of one process (two targets with the same
/// name in one folder, or a retry after a name collision).
static NEXT_TEMP: AtomicU64 = AtomicU64::new(0);

/// A file being written to a temporary beside `target`. Write to it, then
/// call [`AtomicFile::commit`]; dropped without committing, it removes the
/// temporary and the target stays as it was.
pub struct AtomicFile {
    target: PathBuf,
    temp: PathBuf,
    /// `None` once committed: nothing is left to remove.
    out: Option<BufWriter<File>>,
}

impl AtomicFile {
    /// Creates the temporary for `target` (whose folder must exist), after
    /// removing stale temporaries of dead processes from that folder.
    pub fn create(target: &Path) -> Result<AtomicFile> {
        let name = target.file_name().with_context(|| {
            format!(
                "{}: not a file name; name the file to write",
                target.display()
            )
        })?;
        if target.is_dir() {
            bail!(
                "{}: is a folder; name a file to write instead",
                target.display()
            );
        }
        let dir = folder_of(target);
        remove_stale_temporaries(&dir);
        let (temp, file) = create_temp(&dir, name).map_err(|e| {
            anyhow!(
                "{}: cannot create a temporary file in {} ({e}); {}",
                target.display(),
                dir.display(),
                advice(&e)
            )
        })?;
        // The replacement keeps the permissions of the file it replaces
        // (a model someone made read-only for the group stays so).
        if let Ok(meta) = std::fs::metadata(target) {
            let _ = file.set_permissions(meta.permissions());
        }
        Ok(AtomicFile {
            target: target.to_path_buf(),
            temp,
            out: Some(BufWriter::with_capacity(BUFFER_BYTES, file)),
        })
    }

    /// The file this will become.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// The temporary being written.
    pub fn temp_path(&self) -> &Path {
        &self.temp
    }

    /// An error for a failed write to this file, as one line naming the
    /// target, the cause and what to do. Callers use it for errors of the
    /// `Write` methods so that every write failure reads the same.
    pub fn write_error(&self, e: std::io::Error) -> anyhow::Error {
        write_failure(&self.target, &e)
    }

    /// Flushes, fsyncs, renames the temporary over the target and fsyncs
    /// the folder. On error the temporary is removed and the target is
    /// unchanged (unless only the final folder sync failed: then the new
    /// file is in place, which the error says).
    pub fn commit(mut self) -> Result<()> {
        let Some(out) = self.out.as_mut() else {
            return Ok(());
        };
        out.flush().map_err(|e| write_failure(&self.target, &e))?;
        out.get_ref()
            .sync_all()
            .map_err(|e| write_failure(&self.target, &e))?;
        std::fs::rename(&self.temp, &self.target).map_err(|e| {
            anyhow!(
                "{}: cannot move the finished file into place ({e}); {} \
                 The previous file, if any, is unchanged.",
                self.target.display(),
                advice(&e)
            )
        })?;
        // Renamed: the temporary no longer exists, Drop must not touch it.
        self.out = None;
        let dir = folder_of(&self.target);
        File::open(&dir).and_then(|d| d.sync_all()).map_err(|e| {
            anyhow!(
                "{}: written, but its folder {} could not be synced ({e}); \
                 the file may not survive a power cut",
                self.target.display(),
                dir.display()
            )
        })
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.writer()?.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.writer()?.flush()
    }
}

impl AtomicFile {
    fn writer(&mut self) -> std::io::Result<&mut BufWriter<File>> {
        self.out
            .as_mut()
            .ok_or_else(|| std::io::Error::other("the file was already committed"))
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if let Some(out) = self.out.take() {
            // Dropping the BufWriter would try to flush it: pointless work
            // (possibly failing again on a full disk) for a file about to go.
            let (file, _unflushed) = out.into_parts();
            drop(file);
            let _ = std::fs::remove_file(&self.temp);
        }
    }
}

/// Writes `bytes` to `target` atomically.
pub fn write_atomic(target: &Path, bytes: &[u8]) -> Result<()> {
    let mut file = AtomicFile::create(target)?;
    file.write_all(bytes).map_err(|e| file.write_error(e))?;
    file.commit()
}

/// The folder a target lives in (`.` for a bare file name).
fn folder_of(target: &Path) -> PathBuf {
    match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

fn create_temp(dir: &Path, name: &OsStr) -> std::io::Result<(PathBuf, File)> {
    let pid = std::process::id();
    loop {
        let n = NEXT_TEMP.fetch_add(1, Ordering::Relaxed);
        let mut temp_name = std::ffi::OsString::from(".");
        temp_name.push(name);
        temp_name.push(format!("{TEMP_MARKER}{pid}-{n}"));
        let temp = dir.join(temp_name);
        // create_new: never reuse (and so truncate) a file that exists,
        // whoever made it.
        match File::options().write(true).create_new(true).open(&temp) {
            Ok(file) => return Ok((temp, file)),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

/// One line for a failed write: target, cause, what to do, and that the
/// previous file is intact (the reader's first worry).
fn write_failure(target: &Path, e: &std::io::Error) -> anyhow::Error {
    anyhow!(
        "{}: cannot write ({e}); {} The previous file, if any, is unchanged.",
        target.display(),
        advice(e)
    )
}

fn advice(e: &std::io::Error) -> &'static str {
    match e.kind() {
        ErrorKind::StorageFull => "free some space on that disk or write to another folder.",
        ErrorKind::FileTooLarge => {
            "the file is larger than that filesystem or a size limit (ulimit -f) allows; write elsewhere."
        }
        ErrorKind::PermissionDenied | ErrorKind::ReadOnlyFilesystem => {
            "choose a folder you can write to."
        }
        ErrorKind::NotFound => "check that the folder exists.",
        _ => "check the folder and try again.",
    }
}

/// The pid in the name of one of our temporaries, `.{name}{TEMP_MARKER}{pid}-{n}`.
fn temp_owner(file_name: &str) -> Option<u32> {
    let rest = file_name.strip_prefix('.')?;
    let (_, tail) = rest.rsplit_once(TEMP_MARKER)?;
    let (pid, n) = tail.split_once('-')?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    parse_pid(pid)
}

/// A pid as written in a file name: decimal digits only, within the range
/// `kill` treats as one process (0 and negatives address groups).
pub fn parse_pid(s: &str) -> Option<u32> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let pid: u32 = s.parse().ok()?;
    (pid > 0 && pid <= i32::MAX as u32).then_some(pid)
}

/// Whether process `pid` exists. When in doubt (any answer other than
/// "no such process"), alive: a temporary is only removed when its owner
/// is certainly gone. A pid reused by an unrelated process keeps a stale
/// file around a while longer, which is harmless. (A folder shared with
/// another pid namespace, e.g. a container, could see a live writer as
/// dead; Pulsar does not support writing one folder from two namespaces.)
pub fn process_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return true;
    };
    if pid <= 0 {
        return true;
    }
    // SAFETY: kill with signal 0 sends nothing; it only checks that the
    // process exists and may be signalled. pid is positive, so it names
    // one process, never a process group.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Removes our temporaries in `dir` whose writer has died. Best effort:
/// a folder we cannot list or a file we cannot remove only means the
/// leftover stays until a later run.
pub fn remove_stale_temporaries(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(temp_owner) else {
            continue;
        };
        let is_file = entry.file_type().is_ok_and(|t| t.is_file());
        if is_file && !process_alive(pid) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh folder under the system temp dir, removed at the end, pass
    /// or fail: a failed assertion unwinds and drops the `TempDir`.
    struct Folder(tempfile::TempDir);

    impl Folder {
        fn new(tag: &str) -> Folder {
            let dir = tempfile::Builder::new()
                .prefix(&format!("pulsar-fs-atomic-{tag}-"))
                .tempdir()
                .unwrap();
            Folder(dir)
        }

        fn path(&self) -> &Path {
            self.0.path()
        }

        fn names(&self) -> Vec<String> {
            let mut v: Vec<String> = std::fs::read_dir(self.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v
        }
    }

    /// The pid of a process that has exited and been reaped.
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(!process_alive(pid), "pid {pid} was reused at once");
        pid
    }

    #[test]
    fn commit_replaces_the_target_and_leaves_no_temporary() {
        let f = Folder::new("commit");
        let target = f.path().join("out.bin");
        std::fs::write(&target, b"old").unwrap();
        let mut file = AtomicFile::create(&target).unwrap();
        file.write_all(b"new contents").unwrap();
        // Before the commit the target still holds the old bytes.
        assert_eq!(std::fs::read(&target).unwrap(), b"old");
        assert!(file.temp_path().exists());
        file.commit().unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"new contents");
        assert_eq!(f.names(), vec!["out.bin".to_string()]);
    }

    #[test]
    fn dropping_without_commit_removes_the_temporary() {
        let f = Folder::new("drop");
        let target = f.path().join("out.bin");
        std::fs::write(&target, b"old").unwrap();
        let mut file = AtomicFile::create(&target).unwrap();
        file.write_all(&[7u8; 10_000_000]).unwrap();
        let temp = file.temp_path().to_path_buf();
        assert!(temp.exists());
        drop(file);
        assert!(!temp.exists());
        assert_eq!(std::fs::read(&target).unwrap(), b"old");
        assert_eq!(f.names(), vec!["out.bin".to_string()]);
    }

    #[test]
    fn a_panic_while_writing_removes_the_temporary() {
        let f = Folder::new("panic");
        let target = f.path().join("out.bin");
        let result = std::panic::catch_unwind(|| {
            let mut file = AtomicFile::create(&target).unwrap();
            file.write_all(b"partial").unwrap();
            panic!("writer failed");
        });
        assert!(result.is_err());
        assert!(f.names().is_empty(), "left behind: {:?}", f.names());
    }

    #[test]
    fn write_atomic_creates_a_new_file() {
        let f = Folder::new("new");
        let target = f.path().join("fresh.txt");
        write_atomic(&target, b"hello").unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"hello");
        assert_eq!(f.names(), vec!["fresh.txt".to_string()]);
    }

    #[test]
    fn a_folder_as_target_is_refused_by_name() {
        let f = Folder::new("dir");
        let err = write_atomic(f.path(), b"x").unwrap_err().to_string();
        assert!(err.contains("is a folder"), "{err}");
        assert!(err.contains(&f.path().display().to_string()), "{err}");
    }

    #[test]
    fn a_missing_folder_is_reported_with_the_target() {
        let f = Folder::new("missing");
        let target = f.path().join("no-such-folder").join("out.bin");
        let err = format!("{:#}", write_atomic(&target, b"x").unwrap_err());
        assert!(err.contains(&target.display().to_string()), "{err}");
        assert!(err.contains("check that the folder exists"), "{err}");
        assert!(!err.contains('\n'), "one line: {err}");
    }

    #[test]
    fn stale_temporaries_of_dead_processes_are_removed_live_ones_kept() {
        let f = Folder::new("stale");
        let dead = dead_pid();
        let me = std::process::id();
        let stale = format!(".out.bin{TEMP_MARKER}{dead}-0");
        let other_target_stale = format!(".other.gguf{TEMP_MARKER}{dead}-3");
        let live = format!(".out.bin{TEMP_MARKER}{me}-999999");
        // Look-alikes that are not ours, or not well-formed, stay.
        let foreign = [
            format!(".out.bin.tmp-{dead}-0"),
            format!("out.bin{TEMP_MARKER}{dead}-0"),
            format!(".out.bin{TEMP_MARKER}{dead}-"),
            format!(".out.bin{TEMP_MARKER}0-1"),
            "keep.me".to_string(),
        ];
        for n in [&stale, &other_target_stale, &live]
            .into_iter()
            .chain(foreign.iter())
        {
            std::fs::write(f.path().join(n), b"x").unwrap();
        }
        write_atomic(&f.path().join("out.bin"), b"done").unwrap();
        let names = f.names();
        assert!(!names.contains(&stale), "{names:?}");
        assert!(!names.contains(&other_target_stale), "{names:?}");
        assert!(names.contains(&live), "{names:?}");
        for n in &foreign {
            assert!(names.contains(n), "{n} removed: {names:?}");
        }
        assert!(names.contains(&"out.bin".to_string()));
    }

    #[test]
    fn liveness_follows_kill() {
        assert!(process_alive(std::process::id()));
        // pid 1 exists in every namespace (and may be unsignallable: EPERM).
        assert!(process_alive(1));
        assert!(!process_alive(dead_pid()));
    }

    #[test]
    fn pids_in_names_are_strict() {
        assert_eq!(parse_pid("123"), Some(123));
        for bad in ["", "0", "-1", "+5", "12a", "99999999999"] {
            assert_eq!(parse_pid(bad), None, "{bad}");
        }
        assert_eq!(temp_owner(&format!(".a.b{TEMP_MARKER}42-7")), Some(42));
        assert_eq!(temp_owner(&format!(".a{TEMP_MARKER}42-x")), None);
    }

    #[test]
    fn the_replacement_keeps_the_old_permissions() {
        use std::os::unix::fs::PermissionsExt;
        let f = Folder::new("perm");
        let target = f.path().join("out.bin");
        std::fs::write(&target, b"old").unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o640)).unwrap();
        write_atomic(&target, b"new").unwrap();
        let mode = std::fs::metadata(&target).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o640);
    }
}
