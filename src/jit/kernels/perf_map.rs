//! The perf map: names of JIT code for Linux `perf report`.

use super::Compiled;

/// Appends one line per kernel to `/tmp/perf-<pid>.map`, the file Linux
/// `perf report` reads to name samples in JIT code (`PULSAR_PERF_MAP=1`).
/// Profiling aid only: a failure to write is reported and otherwise ignored.
///
/// Not written through `fs_atomic`: the path is fixed by perf's protocol,
/// the file belongs to this one process (its pid is in the name) and is
/// appended to by design — each `KernelSet` of the process adds its lines,
/// which a rename-over would drop. A torn last line from a crash only
/// costs perf a symbol name; nobody keeps the file.
pub(super) fn write_perf_map(base: usize, kernels: &[Compiled]) {
    use std::io::Write;
    let path = format!("/tmp/perf-{}.map", std::process::id());
    let lines: String = kernels
        .iter()
        .map(|k| format!("{:x} {:x} {}\n", base + k.offset, k.code.len(), k.spec.name))
        .collect();
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(lines.as_bytes()));
    if let Err(e) = written {
        eprintln!("pulsar: cannot write the perf map {path}: {e}");
    }
}
