//! Every direct branch target of a live kernel text, kept on disk between runs
//! (`$XDG_CACHE_HOME/exotap/analysis/KEY.targets`): finding them means reading and decoding
//! all 14 MB of the text, the one part of an attach that grows with the kernel. The key is the
//! sha256 of what they follow from, so an entry is only ever used for a text that has them:
//! - the build ([`Identity::Build`]: its GNU build-id) and the guest's boot-time CPU
//!   capabilities (`boot_cpu_data.x86_capability`, the feature and bug words that decide the
//!   alternatives, retpolines and returns the kernel patched into its text at boot), the
//!   function starts and the return thunks, all relative to the text's start: the targets are
//!   stored as offsets from it, so one entry serves every boot of the build on such a CPU,
//!   whatever its KASLR slide. What the kernel changes in its text after
//!   boot adds no direct branch inside it but its jump labels, whose targets are stored
//!   whatever their keys' state (`LiveKernel`); and each function a plan touches is checked
//!   against the entry when its bytes are read (`LiveKernel::prepare`).
//! - or, for a build without a build-id or a guest whose CPU state cannot be read, the text's
//!   bytes themselves ([`Identity::Text`]), read whole as before.
//!
//! A file that does not read back whole (bad magic, short, a payload whose sha256 differs, targets out of order)
//! is not used, and is written again.
//!
//! The format: the magic `EXOTAPBT`, a u32 version, a u32 of zero, the u64 target count, the
//! 32-byte sha256 of the payload, then the payload: each target inside the text a
//! little-endian u64, its offset from the text's start, in order. (Targets outside the text,
//! calls into ftrace trampolines or modules, change from boot to boot and concern no plan.)

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use exotap_introspect::x86::{AnalysisConfig, BranchTargets, FunctionRange};
use sha2::{Digest, Sha256};

const MAGIC: &[u8; 8] = b"EXOTAPBT";
/// 4: keyed by the build and CPU capabilities, the text's own targets relative to it,
/// jump-label targets included.
const VERSION: u32 = 4;
const HEADER: usize = 8 + 4 + 4 + 8 + 32;
/// How many entries the directory keeps (the oldest go first): one per boot of each guest a
/// host instruments, and a file is ~2 MB.
const KEEP: usize = 32;

/// What, besides its place, functions and thunks, decides a text's branch targets.
#[derive(Debug, Clone, Copy)]
pub enum Identity<'a> {
    /// The build's GNU build-id and the guest's boot-time CPU capabilities.
    Build {
        /// The build-id.
        build: &'a [u8],
        /// `boot_cpu_data.x86_capability`.
        cpu: &'a [u8],
    },
    /// The live text's bytes (and its place: relocated, they depend on it).
    Text(&'a [u8]),
}

/// The file holding the targets of the text at `base` that `identity` names, named by the
/// hash of everything they follow from.
pub fn entry(
    root: &Path,
    base: u64,
    identity: Identity<'_>,
    ranges: &[FunctionRange],
    config: &AnalysisConfig,
) -> PathBuf {
    let mut h = Sha256::new();
    h.update(VERSION.to_le_bytes());
    let field = |h: &mut Sha256, tag: u8, bytes: &[u8]| {
        h.update([tag]);
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    match identity {
        Identity::Build { build, cpu } => {
            field(&mut h, b'B', build);
            field(&mut h, b'C', cpu);
        }
        Identity::Text(text) => {
            field(&mut h, b'T', text);
            h.update(base.to_le_bytes());
        }
    }
    let rel = |a: u64| a.wrapping_sub(base).to_le_bytes();
    h.update((ranges.len() as u64).to_le_bytes());
    for r in ranges {
        h.update(rel(r.start));
        h.update(rel(r.end));
    }
    for t in config.return_thunks() {
        h.update(rel(*t));
    }
    let key = exotap_guest_images::cache::hex(&h.finalize());
    root.join(format!("{}.targets", &key[..40]))
}

/// The targets stored in `path`, for the text at `base`.
///
/// # Errors
/// When the file cannot be read or does not read back whole (see the module's doc).
pub fn load(path: &Path, base: u64) -> anyhow::Result<BranchTargets> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    if bytes.len() < HEADER || &bytes[..8] != MAGIC {
        bail!("not a branch-target file");
    }
    let word = |at: usize| -> [u8; 8] {
        let mut w = [0u8; 8];
        w.copy_from_slice(&bytes[at..at + 8]);
        w
    };
    let version = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
    if version != VERSION {
        bail!("version {version}, not {VERSION}");
    }
    let count = usize::try_from(u64::from_le_bytes(word(16)))?;
    let payload = &bytes[HEADER..];
    if Some(payload.len()) != count.checked_mul(8) {
        bail!("{} payload bytes for {count} targets", payload.len());
    }
    if Sha256::digest(payload)[..] != bytes[24..HEADER] {
        bail!("the payload's sha256 differs from its header's");
    }
    let targets = payload
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()).wrapping_add(base))
        .collect();
    BranchTargets::from_sorted(targets).context("the targets are out of order")
}

/// Stores `targets` of the text at `base` in `path` (through a temporary name: a reader never
/// sees half a file) and drops the oldest entries past [`KEEP`].
///
/// # Errors
/// When the directory or the file cannot be written.
pub fn store(path: &Path, base: u64, targets: &BranchTargets) -> anyhow::Result<()> {
    let dir = path.parent().context("an entry has a directory")?;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut payload = Vec::with_capacity(targets.len() * 8);
    for t in targets.as_slice() {
        payload.extend_from_slice(&t.wrapping_sub(base).to_le_bytes());
    }
    let mut out = Vec::with_capacity(HEADER + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&(targets.len() as u64).to_le_bytes());
    out.extend_from_slice(&Sha256::digest(&payload));
    out.extend_from_slice(&payload);
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, &out).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    prune(dir);
    Ok(())
}

/// Removes all but the [`KEEP`] most recently modified entries of `dir`.
fn prune(dir: &Path) {
    let Ok(read) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<(std::time::SystemTime, PathBuf)> = read
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "targets"))
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .collect();
    entries.sort_by_key(|e| std::cmp::Reverse(e.0));
    for (_, old) in entries.into_iter().skip(KEEP) {
        let _ = std::fs::remove_file(old);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranges() -> Vec<FunctionRange> {
        vec![FunctionRange {
            start: 0x1000,
            end: 0x1010,
        }]
    }

    #[test]
    fn targets_round_trip_and_a_damaged_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = entry(
            dir.path(),
            0x1000,
            Identity::Text(&[0xc3; 16]),
            &ranges(),
            &AnalysisConfig::new(),
        );
        let targets =
            BranchTargets::from_sorted(vec![0x1000, 0x1004, 0xffff_ffff_8100_0000]).unwrap();

        store(&path, 0x1000, &targets).unwrap();
        assert_eq!(load(&path, 0x1000).unwrap(), targets);
        // Another boot's text, 16 MiB further: the same targets, moved with it.
        let moved =
            BranchTargets::from_sorted(targets.as_slice().iter().map(|t| t + (16 << 20)).collect())
                .unwrap();
        assert_eq!(load(&path, 0x1000 + (16 << 20)).unwrap(), moved);

        let good = std::fs::read(&path).unwrap();
        let mut flipped = good.clone();
        *flipped.last_mut().unwrap() ^= 1;
        let mut short = good.clone();
        short.truncate(good.len() - 8);
        let mut magic = good.clone();
        magic[0] = b'X';
        for (what, bytes) in [
            ("a flipped target", flipped),
            ("a short file", short),
            ("bad magic", magic),
        ] {
            std::fs::write(&path, bytes).unwrap();
            assert!(load(&path, 0x1000).is_err(), "{what} was read back");
        }
    }

    #[test]
    fn the_key_changes_with_the_build_the_cpu_state_the_text_its_place_its_functions_and_its_thunks(
    ) {
        let dir = tempfile::tempdir().unwrap();
        let config = AnalysisConfig::new();
        let key = |base, id: Identity<'_>, ranges: &[FunctionRange], config: &AnalysisConfig| {
            entry(dir.path(), base, id, ranges, config)
        };
        let build = Identity::Build {
            build: &[1; 20],
            cpu: &[7; 64],
        };
        let one = key(0x1000, build, &ranges(), &config);

        assert_eq!(one, key(0x1000, build, &ranges(), &config));
        // Another slide moves the functions and thunks with the text: the same entry.
        let slid: Vec<FunctionRange> = ranges()
            .iter()
            .map(|r| FunctionRange {
                start: r.start + 0x1000,
                end: r.end + 0x1000,
            })
            .collect();
        assert_eq!(one, key(0x2000, build, &slid, &config));
        // The same functions at another place in the text: another entry.
        assert_ne!(one, key(0x2000, build, &ranges(), &config));
        let other_build = Identity::Build {
            build: &[2; 20],
            cpu: &[7; 64],
        };
        assert_ne!(one, key(0x1000, other_build, &ranges(), &config));
        // One capability bit of the boot CPU.
        let mut cpu = [7u8; 64];
        cpu[40] ^= 0x10;
        let other_cpu = Identity::Build {
            build: &[1; 20],
            cpu: &cpu,
        };
        assert_ne!(one, key(0x1000, other_cpu, &ranges(), &config));
        assert_ne!(one, key(0x1000, build, &ranges()[..0], &config));
        assert_ne!(
            one,
            key(
                0x1000,
                build,
                &ranges(),
                &AnalysisConfig::new().with_return_thunk(0x1008)
            )
        );
        // A text keyed by its bytes: never the build's entry, and its bytes count.
        let text = key(0x1000, Identity::Text(&[0xc3; 16]), &ranges(), &config);
        assert_ne!(one, text);
        assert_eq!(
            text,
            key(0x1000, Identity::Text(&[0xc3; 16]), &ranges(), &config)
        );
        assert_ne!(
            text,
            key(0x1000, Identity::Text(&[0x90; 16]), &ranges(), &config)
        );
        // The build-id's bytes cannot pass for the CPU state's.
        let shifted = Identity::Build {
            build: &[1; 19],
            cpu: &[1; 65],
        };
        assert_ne!(
            key(
                0x1000,
                Identity::Build {
                    build: &[1; 20],
                    cpu: &[1; 64]
                },
                &ranges(),
                &config
            ),
            key(0x1000, shifted, &ranges(), &config)
        );
    }
}
