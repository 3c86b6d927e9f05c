//! Debian kernels, their debug info and busybox, fetched once into the cache and verified on
//! every reuse.
//!
//! Layout under the cache root:
//! ```text
//! kernels/<abi>/manifest.json         vmlinuz, config, modules/{irqbypass,kvm,kvm-amd,kvm-intel,evdev}.ko
//!                                     (those of the modules the package has)
//! kernels/<abi>/debug/manifest.json   vmlinux, System.map, modules.list and
//!                                     modules/{irqbypass,kvm,kvm-amd,kvm-intel,evdev,nfsd}.ko
//!                                     (the modules' debug files)   (image fetch --debuginfo)
//! packages/busybox-static/manifest.json   busybox
//! ```
//! `<abi>` is the kernel's ABI name, e.g. `6.1.0-50-cloud-amd64`.

use std::fs;
use std::path::{Path, PathBuf};

use crate::cache::{self, CacheError, Manifest};
use crate::debian::{self, DebianError};

/// The kernel exotap boots unless told otherwise.
pub const DEFAULT_KERNEL: &str = "6.1.0-50-cloud-amd64";

/// The modules kept, by file name: kvm and its vendor modules for the nested-KVM harness,
/// and evdev (no dependencies; a reader of `/dev/input/eventN` sleeps in its code) for the
/// tests of unwinding through module text.
pub const KEPT_MODULES: &[&str] = &[
    "irqbypass.ko",
    "kvm.ko",
    "kvm-amd.ko",
    "kvm-intel.ko",
    "evdev.ko",
];

/// The modules whose debug files (ELF relocatable objects with DWARF) are kept with the
/// vmlinux: the kept modules, and nfsd (SystemTap's nfsd tapset and examples).
pub const DEBUG_MODULES: &[&str] = &[
    "irqbypass.ko",
    "kvm.ko",
    "kvm-amd.ko",
    "kvm-intel.ko",
    "evdev.ko",
    "nfsd.ko",
];

/// The file of the debug component listing the [`DEBUG_MODULES`] the package had (one name
/// a line): a debug cache made before the modules were kept lacks it, and is fetched again.
const DEBUG_MODULES_LIST: &str = "modules.list";

/// Errors of fetching guest images.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The cache failed.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// apt or dpkg failed.
    #[error(transparent)]
    Debian(#[from] DebianError),
    /// The kernel name is not one we understand.
    #[error("`{0}` is not a kernel ABI name like 6.1.0-50-cloud-amd64 or a package name like linux-image-6.1.0-50-cloud-amd64-unsigned")]
    BadKernelName(String),
    /// A directory could not be prepared.
    #[error("cannot prepare {path}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A compressed module could not be decompressed.
    #[error("cannot decompress {module}")]
    Module {
        /// The module's file, relative to the cache directory.
        module: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The package lacked files we need.
    #[error("{package} {version} lacks {missing}")]
    Incomplete {
        /// The package.
        package: String,
        /// Its version.
        version: String,
        /// What is missing.
        missing: String,
    },
}

/// A kernel in the cache, verified.
#[derive(Debug, Clone)]
pub struct Kernel {
    /// ABI name, e.g. `6.1.0-50-cloud-amd64`.
    pub abi: String,
    /// Debian package version, e.g. `6.1.176-1`.
    pub version: String,
    /// The component directory.
    pub dir: PathBuf,
    /// The bzImage.
    pub bzimage: PathBuf,
    /// The kernel's build configuration.
    pub config: PathBuf,
    /// The kept modules the package has (see [`KEPT_MODULES`]).
    pub modules: Vec<PathBuf>,
    /// The kept modules the package does not have (built in, or not built).
    pub lacking_modules: Vec<String>,
}

/// Debug info of a kernel, verified.
#[derive(Debug, Clone)]
pub struct Debuginfo {
    /// The ELF vmlinux with DWARF.
    pub vmlinux: PathBuf,
    /// The full System.map.
    pub system_map: PathBuf,
    /// The debug files of the [`DEBUG_MODULES`] the package has (`debug/modules/NAME.ko`).
    pub modules: Vec<PathBuf>,
}

/// Turns `6.1.0-50-cloud-amd64` or `linux-image-6.1.0-50-cloud-amd64-unsigned` into the ABI name.
///
/// # Errors
/// [`ImageError::BadKernelName`] for anything else.
pub fn kernel_abi(name: &str) -> Result<String, ImageError> {
    let abi = name
        .strip_prefix("linux-image-")
        .unwrap_or(name)
        .trim_end_matches("-unsigned")
        .trim_end_matches("-dbg");
    let ok = abi.chars().next().is_some_and(|c| c.is_ascii_digit())
        && abi.contains('-')
        && abi
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '+' | '_'));
    if ok {
        Ok(abi.to_owned())
    } else {
        Err(ImageError::BadKernelName(name.to_owned()))
    }
}

/// What the cache holds of kernel `abi`: (the kernel, its debug info), by their manifests
/// (a fetch verifies the files themselves).
///
/// # Errors
/// When the cache directory cannot be found.
pub fn cached(abi: &str) -> Result<(bool, bool), ImageError> {
    let dir = kernel_dir(abi)?;
    Ok((
        dir.join(cache::MANIFEST).is_file(),
        dir.join("debug").join(cache::MANIFEST).is_file(),
    ))
}

fn kernel_dir(abi: &str) -> Result<PathBuf, ImageError> {
    Ok(cache::cache_root()?.join("kernels").join(abi))
}

/// Where packages come from: apt in real use, a local file in tests.
pub trait PackageSource {
    /// The candidate version of `name`, `None` when unknown.
    ///
    /// # Errors
    /// When the source cannot be asked.
    fn candidate(&self, name: &str) -> Result<Option<debian::PackageInfo>, DebianError>;
    /// Downloads the package's .deb into the empty directory `dir`.
    ///
    /// # Errors
    /// When the download fails.
    fn download(&self, info: &debian::PackageInfo, dir: &Path) -> Result<PathBuf, DebianError>;
}

/// Packages from the host's apt configuration.
#[derive(Debug, Default, Clone, Copy)]
pub struct Apt;

impl PackageSource for Apt {
    fn candidate(&self, name: &str) -> Result<Option<debian::PackageInfo>, DebianError> {
        debian::candidate(name)
    }
    fn download(&self, info: &debian::PackageInfo, dir: &Path) -> Result<PathBuf, DebianError> {
        debian::download(info, dir)
    }
}

/// What a component does to the files it unpacked (see [`Component::finish`]).
type Finish = dyn Fn(&Path, Vec<String>) -> Result<Vec<String>, ImageError>;

/// A cached component: a directory filled from one Debian package.
struct Component<'a> {
    source: &'a dyn PackageSource,
    dir: PathBuf,
    package: String,
    required: &'a [&'a str],
    select: &'a dyn Fn(&str) -> Option<String>,
    /// Turns the files `select` wrote into the ones the cache keeps (named relative to the
    /// component's directory), e.g. a compressed module into the module.
    finish: &'a Finish,
    /// Said when apt does not know the package.
    suggestion: &'a dyn Fn() -> Option<String>,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ImageError + '_ {
    move |source| ImageError::Io {
        path: path.to_owned(),
        source,
    }
}

impl Component<'_> {
    /// Returns the verified manifest, fetching the package first when the cache cannot be used.
    fn ensure(&self) -> Result<Manifest, ImageError> {
        fs::create_dir_all(&self.dir).map_err(io_err(&self.dir))?;
        // Serialise fetches of one component between processes (tests run in parallel).
        let lock_path = self.dir.join(".lock");
        let lock = fs::File::create(&lock_path).map_err(io_err(&lock_path))?;
        lock.lock().map_err(io_err(&lock_path))?;
        match cache::verify(&self.dir, self.required) {
            Ok(manifest) => {
                tracing::debug!(package = %self.package, dir = %self.dir.display(), "cached and verified");
                return Ok(manifest);
            }
            Err(cache::Staleness::Missing) => {
                tracing::info!(package = %self.package, "not cached yet: fetching");
            }
            Err(why) => {
                tracing::warn!(package = %self.package, "cached copy unusable, {why}: fetching again");
            }
        }
        cache::invalidate(&self.dir);
        let info =
            self.source
                .candidate(&self.package)?
                .ok_or_else(|| DebianError::UnknownPackage {
                    package: self.package.clone(),
                    suggestion: (self.suggestion)(),
                })?;
        let download_dir = self.dir.join(".download");
        let _ = fs::remove_dir_all(&download_dir);
        fs::create_dir_all(&download_dir).map_err(io_err(&download_dir))?;
        let deb = self.source.download(&info, &download_dir)?;
        let written = (self.finish)(&self.dir, debian::extract(&deb, &self.dir, self.select)?)?;
        let _ = fs::remove_dir_all(&download_dir);
        if let Some(missing) = self
            .required
            .iter()
            .find(|r| !written.iter().any(|w| w == *r))
        {
            return Err(ImageError::Incomplete {
                package: info.name,
                version: info.version,
                missing: (*missing).to_owned(),
            });
        }
        let manifest = cache::seal(&self.dir, &info.name, &info.version, &written)?;
        tracing::info!(package = %info.name, version = %info.version, files = written.len(), "fetched into the cache");
        Ok(manifest)
    }
}

fn cloud_suggestion() -> Option<String> {
    match debian::newest_cloud_kernel() {
        Ok(Some(newest)) => Some(format!(
            "it may be gone from the archive. The newest cloud kernel apt knows is {newest}: use --kernel {}",
            kernel_abi(&newest).unwrap_or(newest.clone())
        )),
        Ok(None) => Some("apt knows no linux-image-*-cloud-amd64-unsigned at all: run apt-get update".into()),
        Err(e) => Some(format!("and apt-cache search failed too: {e}")),
    }
}

/// The most bytes one module decompresses to (kvm.ko is about 2 MB).
const MAX_MODULE: u64 = 64 << 20;

/// Decompresses the `modules/*.ko.xz` among `written` (files under `dir`) into `modules/*.ko`,
/// removing the compressed files.
fn decompress_modules(dir: &Path, written: Vec<String>) -> Result<Vec<String>, ImageError> {
    use std::io::Read;
    let mut kept = Vec::with_capacity(written.len());
    for name in written {
        let Some(module) = name.strip_suffix(".xz") else {
            kept.push(name);
            continue;
        };
        let (from, to) = (dir.join(&name), dir.join(module));
        let compressed = fs::File::open(&from).map_err(io_err(&from))?;
        let mut out = Vec::new();
        lzma_rust2::XzReader::new(std::io::BufReader::new(compressed), false)
            .take(MAX_MODULE + 1)
            .read_to_end(&mut out)
            .map_err(|source| ImageError::Module {
                module: name.clone(),
                source,
            })?;
        if out.len() as u64 > MAX_MODULE {
            return Err(ImageError::Module {
                module: name,
                source: std::io::Error::other(format!(
                    "it decompresses to more than {MAX_MODULE} bytes"
                )),
            });
        }
        fs::write(&to, &out).map_err(io_err(&to))?;
        fs::remove_file(&from).map_err(io_err(&from))?;
        kept.push(module.to_owned());
    }
    Ok(kept)
}

/// Makes sure the kernel `name` (ABI or package name) is in the cache and intact, fetching it
/// when needed. A second call downloads nothing and needs no network.
///
/// # Errors
/// When the kernel cannot be fetched, unpacked or verified.
pub fn ensure_kernel(name: &str) -> Result<Kernel, ImageError> {
    let abi = kernel_abi(name)?;
    let dir = kernel_dir(&abi)?;
    let vmlinuz = format!("boot/vmlinuz-{abi}");
    let config = format!("boot/config-{abi}");
    let select = |path: &str| -> Option<String> {
        if path == vmlinuz {
            return Some("vmlinuz".into());
        }
        if path == config {
            return Some("config".into());
        }
        let file = path.rsplit('/').next()?;
        // Debian's 6.12 packages ship their modules xz-compressed (`kvm.ko.xz`).
        let module = file.strip_suffix(".xz").unwrap_or(file);
        (path.starts_with("lib/modules/") && KEPT_MODULES.contains(&module))
            .then(|| format!("modules/{file}"))
    };
    // The modules are optional: a kernel may build one in or lack it (Debian's 6.12 has no
    // irqbypass.ko); what it has is kept, what it lacks is said.
    let manifest = Component {
        source: &Apt,
        dir: dir.clone(),
        package: format!("linux-image-{abi}-unsigned"),
        required: &["vmlinuz", "config"],
        select: &select,
        finish: &decompress_modules,
        suggestion: &cloud_suggestion,
    }
    .ensure()?;
    let (kept, lacking): (Vec<&str>, Vec<&str>) = KEPT_MODULES
        .iter()
        .partition(|m| manifest.files.contains_key(&format!("modules/{m}")));
    if !lacking.is_empty() {
        tracing::debug!(
            kernel = %abi,
            "the package has no {} (built in, or not built): tests that load them skip",
            lacking.join(", ")
        );
    }
    Ok(Kernel {
        abi,
        version: manifest.version,
        bzimage: dir.join("vmlinuz"),
        config: dir.join("config"),
        modules: kept
            .iter()
            .map(|m| dir.join(format!("modules/{m}")))
            .collect(),
        lacking_modules: lacking.iter().map(|m| (*m).to_owned()).collect(),
        dir,
    })
}

/// Makes sure the debug info (`vmlinux` with DWARF, the full `System.map` and the debug files
/// of the [`DEBUG_MODULES`]) of kernel `name` is cached, fetching only those files from the
/// `-dbg` package.
///
/// # Errors
/// When the debug package cannot be fetched, unpacked or verified.
pub fn ensure_debuginfo(name: &str) -> Result<Debuginfo, ImageError> {
    let abi = kernel_abi(name)?;
    let dir = kernel_dir(&abi)?.join("debug");
    let select = debug_select(&abi);
    let manifest = Component {
        source: &Apt,
        dir: dir.clone(),
        package: format!("linux-image-{abi}-dbg"),
        required: &["vmlinux", "System.map", DEBUG_MODULES_LIST],
        select: &select,
        finish: &list_debug_modules,
        suggestion: &|| None,
    }
    .ensure()?;
    Ok(Debuginfo {
        vmlinux: dir.join("vmlinux"),
        system_map: dir.join("System.map"),
        modules: manifest
            .files
            .keys()
            .filter(|f| f.starts_with("modules/"))
            .map(|f| dir.join(f))
            .collect(),
    })
}

/// Which files of kernel `abi`'s `-dbg` package the cache keeps, and under which names.
fn debug_select(abi: &str) -> impl Fn(&str) -> Option<String> {
    let vmlinux = format!("usr/lib/debug/boot/vmlinux-{abi}");
    let map = format!("usr/lib/debug/boot/System.map-{abi}");
    let modules = format!("usr/lib/debug/lib/modules/{abi}/kernel/");
    move |path: &str| -> Option<String> {
        if path == vmlinux {
            Some("vmlinux".into())
        } else if path == map {
            Some("System.map".into())
        } else {
            let file = path.strip_prefix(&modules)?.rsplit('/').next()?;
            DEBUG_MODULES
                .contains(&file)
                .then(|| format!("modules/{file}"))
        }
    }
}

/// Writes [`DEBUG_MODULES_LIST`]: which of the [`DEBUG_MODULES`] the package had.
fn list_debug_modules(dir: &Path, mut written: Vec<String>) -> Result<Vec<String>, ImageError> {
    let mut names: Vec<&str> = written
        .iter()
        .filter_map(|w| w.strip_prefix("modules/"))
        .collect();
    names.sort_unstable();
    let list = dir.join(DEBUG_MODULES_LIST);
    let text: String = names.iter().map(|n| format!("{n}\n")).collect();
    fs::write(&list, text).map_err(io_err(&list))?;
    written.push(DEBUG_MODULES_LIST.to_owned());
    Ok(written)
}

/// Makes sure a static busybox (Debian's `busybox-static`) is cached; returns its path.
///
/// # Errors
/// When the package cannot be fetched, unpacked or verified.
pub fn ensure_busybox() -> Result<PathBuf, ImageError> {
    let dir = cache::cache_root()?.join("packages").join("busybox-static");
    let select = |path: &str| (path == "bin/busybox").then(|| "busybox".to_owned());
    Component {
        source: &Apt,
        dir: dir.clone(),
        package: "busybox-static".into(),
        required: &["busybox"],
        select: &select,
        finish: &|_, written| Ok(written),
        suggestion: &|| Some("install it with apt-get update first".into()),
    }
    .ensure()?;
    Ok(dir.join("busybox"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::process::Command;

    /// Serves one locally built .deb and counts downloads.
    struct LocalDeb {
        deb: PathBuf,
        downloads: Cell<u32>,
    }

    impl PackageSource for LocalDeb {
        fn candidate(&self, name: &str) -> Result<Option<debian::PackageInfo>, DebianError> {
            Ok((name == "exotap-test-kernel").then(|| debian::PackageInfo {
                name: name.into(),
                version: "1.0".into(),
                size: None,
            }))
        }
        fn download(&self, _: &debian::PackageInfo, dir: &Path) -> Result<PathBuf, DebianError> {
            self.downloads.set(self.downloads.get() + 1);
            let to = dir.join("exotap-test-kernel_1.0_amd64.deb");
            fs::copy(&self.deb, &to).map_err(|source| DebianError::Io {
                path: to.clone(),
                source,
            })?;
            Ok(to)
        }
    }

    /// Builds a .deb holding boot/vmlinuz-test and an unrelated file, with dpkg-deb.
    fn local_deb(dir: &Path) -> Option<LocalDeb> {
        let root = dir.join("pkgroot");
        fs::create_dir_all(root.join("DEBIAN")).unwrap();
        fs::create_dir_all(root.join("boot")).unwrap();
        fs::write(
            root.join("DEBIAN/control"),
            "Package: exotap-test-kernel\nVersion: 1.0\nArchitecture: amd64\nMaintainer: t <t@t>\nDescription: t\n",
        )
        .unwrap();
        fs::write(root.join("boot/vmlinuz-test"), vec![0x42u8; 100_000]).unwrap();
        fs::write(root.join("boot/other"), b"not wanted").unwrap();
        let deb = dir.join("test.deb");
        let built = Command::new("dpkg-deb")
            .args(["--root-owner-group", "-Znone", "--build"])
            .arg(&root)
            .arg(&deb)
            .output();
        // Only a missing dpkg-deb skips; one that runs and fails is a failure.
        let out = match built {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => panic!("cannot run dpkg-deb: {e}"),
            Ok(out) => out,
        };
        assert!(
            out.status.success(),
            "dpkg-deb --build failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Some(LocalDeb {
            deb,
            downloads: Cell::new(0),
        })
    }

    fn component<'a>(
        source: &'a LocalDeb,
        dir: &Path,
        select: &'a dyn Fn(&str) -> Option<String>,
    ) -> Component<'a> {
        Component {
            source,
            dir: dir.to_owned(),
            package: "exotap-test-kernel".into(),
            required: &["vmlinuz"],
            select,
            finish: &decompress_modules,
            suggestion: &|| None,
        }
    }

    #[test]
    fn the_debug_package_keeps_vmlinux_system_map_and_the_listed_modules_debug_files() {
        let select = debug_select("6.1.0-50-cloud-amd64");
        let debug = "usr/lib/debug";
        for (path, kept) in [
            ("boot/vmlinux-6.1.0-50-cloud-amd64", Some("vmlinux")),
            ("boot/System.map-6.1.0-50-cloud-amd64", Some("System.map")),
            (
                "lib/modules/6.1.0-50-cloud-amd64/kernel/fs/nfsd/nfsd.ko",
                Some("modules/nfsd.ko"),
            ),
            (
                "lib/modules/6.1.0-50-cloud-amd64/kernel/arch/x86/kvm/kvm-amd.ko",
                Some("modules/kvm-amd.ko"),
            ),
            // Not listed, another kernel's, or not under kernel/.
            (
                "lib/modules/6.1.0-50-cloud-amd64/kernel/fs/ext4/ext4.ko",
                None,
            ),
            ("lib/modules/6.1.0-57-amd64/kernel/fs/nfsd/nfsd.ko", None),
            ("boot/vmlinux-6.1.0-57-amd64", None),
            ("lib/modules/6.1.0-50-cloud-amd64/nfsd.ko", None),
        ] {
            assert_eq!(
                select(&format!("{debug}/{path}")).as_deref(),
                kept,
                "{path}"
            );
        }
        let tmp = tempfile::tempdir().unwrap();
        let written = list_debug_modules(
            tmp.path(),
            vec![
                "vmlinux".into(),
                "modules/nfsd.ko".into(),
                "modules/evdev.ko".into(),
            ],
        )
        .unwrap();
        assert_eq!(written.last().map(String::as_str), Some(DEBUG_MODULES_LIST));
        assert_eq!(
            fs::read_to_string(tmp.path().join(DEBUG_MODULES_LIST)).unwrap(),
            "evdev.ko\nnfsd.ko\n"
        );
    }

    #[test]
    fn xz_modules_are_kept_decompressed_and_a_corrupt_one_is_an_error() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        fs::create_dir_all(dir.join("modules")).unwrap();
        let module: Vec<u8> = (0..200_000u32)
            .flat_map(|i| (i % 251).to_le_bytes())
            .collect();
        fs::write(dir.join("modules/evdev.ko"), &module).unwrap();
        // As Debian's build compresses them: xz with a CRC32 check.
        let xz = Command::new("xz")
            .args(["--check=crc32", "-9", "-f"])
            .arg(dir.join("modules/evdev.ko"))
            .status();
        let xz = match xz {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                eprintln!("SKIP: xz is not installed (ci/install-deps.sh installs xz-utils)");
                return;
            }
            Err(e) => panic!("cannot run xz: {e}"),
            Ok(xz) => xz,
        };
        assert!(xz.success(), "xz failed");
        fs::write(dir.join("modules/kvm.ko.xz"), b"\xfd7zXZ\x00 not really").unwrap();

        let kept = decompress_modules(dir, vec!["vmlinuz".into(), "modules/evdev.ko.xz".into()]);
        let corrupt = decompress_modules(dir, vec!["modules/kvm.ko.xz".into()]);

        assert_eq!(kept.unwrap(), ["vmlinuz", "modules/evdev.ko"]);
        assert_eq!(fs::read(dir.join("modules/evdev.ko")).unwrap(), module);
        assert!(!dir.join("modules/evdev.ko.xz").exists());
        assert!(
            matches!(corrupt, Err(ImageError::Module { ref module, .. }) if module == "modules/kvm.ko.xz"),
            "{corrupt:?}"
        );
    }

    #[test]
    fn corrupted_cache_file_is_detected_and_fetched_again() {
        let tmp = tempfile::tempdir().unwrap();
        let Some(source) = local_deb(tmp.path()) else {
            eprintln!("SKIP: dpkg-deb is not installed; cannot build a test package");
            return;
        };
        let select = |p: &str| (p == "boot/vmlinuz-test").then(|| "vmlinuz".to_owned());
        let dir = tmp.path().join("cache/kernels/test");

        let first = component(&source, &dir, &select).ensure().unwrap();
        let second = component(&source, &dir, &select).ensure().unwrap();
        let downloads_before_corruption = source.downloads.get();
        let mut bytes = fs::read(dir.join("vmlinuz")).unwrap();
        bytes[5000] ^= 0xff;
        fs::write(dir.join("vmlinuz"), &bytes).unwrap();
        let third = component(&source, &dir, &select).ensure().unwrap();

        assert_eq!(
            downloads_before_corruption, 1,
            "a verified cache must not download again"
        );
        assert_eq!(first, second);
        assert_eq!(
            source.downloads.get(),
            2,
            "corruption must trigger a new download"
        );
        assert_eq!(third, first);
        assert_eq!(
            fs::read(dir.join("vmlinuz")).unwrap(),
            vec![0x42u8; 100_000]
        );
        assert!(
            !dir.join("other").exists(),
            "only selected files are unpacked"
        );
    }

    #[test]
    fn unknown_package_says_so() {
        let tmp = tempfile::tempdir().unwrap();
        let Some(source) = local_deb(tmp.path()) else {
            eprintln!("SKIP: dpkg-deb is not installed; cannot build a test package");
            return;
        };
        let select = |_: &str| None;
        let mut c = component(&source, &tmp.path().join("c"), &select);
        c.package = "no-such-package".into();

        let err = c.ensure().unwrap_err();

        assert!(
            err.to_string()
                .contains("apt does not know the package no-such-package"),
            "{err}"
        );
        assert_eq!(source.downloads.get(), 0);
    }

    #[test]
    fn abi_accepts_abi_and_package_names() {
        assert_eq!(
            kernel_abi("6.1.0-50-cloud-amd64").unwrap(),
            "6.1.0-50-cloud-amd64"
        );
        assert_eq!(
            kernel_abi("linux-image-6.12.115+deb12-cloud-amd64-unsigned").unwrap(),
            "6.12.115+deb12-cloud-amd64"
        );
    }

    #[test]
    fn abi_rejects_paths_and_garbage() {
        assert!(kernel_abi("../../etc").is_err());
        assert!(kernel_abi("cloud").is_err());
        assert!(kernel_abi("6.1.0-50/../x").is_err());
    }
}
