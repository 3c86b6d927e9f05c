//! What this host can virtualize with: hardware KVM, kvm_pvm, or nothing.
//!
//! `kvm_pvm` is a software ("pagetable-based") virtualization module: `/dev/kvm` exists and runs
//! real-mode toys, but an unmodified Linux kernel crawls and then dies on emulation failures
//! (`int3`, `xrstor`, `cmpxchg16b`). exotap detects it and does not use it.

use std::path::Path;

/// Hardware virtualization vendors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vendor {
    /// VMX (kvm_intel).
    Intel,
    /// SVM (kvm_amd).
    Amd,
}

/// What `/dev/kvm` is on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvmSupport {
    /// Hardware-assisted KVM that boots Linux.
    Hardware(Vendor),
    /// kvm_pvm software virtualization: cannot run Linux.
    Pvm,
    /// No `/dev/kvm`.
    NoDevice,
    /// `/dev/kvm` exists but cannot be opened.
    NoAccess(String),
    /// `/dev/kvm` exists but neither kvm_intel nor kvm_amd is loaded and the CPU shows no VMX/SVM.
    Unknown,
}

impl KvmSupport {
    /// Whether QEMU may use `-enable-kvm` (and exotap's own VMM may run).
    pub fn usable(&self) -> bool {
        matches!(self, Self::Hardware(_))
    }

    /// One line saying what was found and what follows.
    pub fn explain(&self) -> String {
        match self {
            Self::Hardware(Vendor::Intel) => "hardware KVM (Intel VMX, kvm_intel) is available".into(),
            Self::Hardware(Vendor::Amd) => "hardware KVM (AMD SVM, kvm_amd) is available".into(),
            Self::Pvm => "/dev/kvm is kvm_pvm (software pagetable-based virtualization, no VMX/SVM): \
                          it cannot run an unmodified Linux kernel (emulation failures at int3/xrstor/cmpxchg16b), \
                          so exotap uses QEMU TCG instead"
                .into(),
            Self::NoDevice => "there is no /dev/kvm on this host: exotap uses QEMU TCG".into(),
            Self::NoAccess(why) => format!("/dev/kvm cannot be opened ({why}): exotap uses QEMU TCG"),
            Self::Unknown => "/dev/kvm exists but neither kvm_intel nor kvm_amd is loaded and the CPU \
                              shows no vmx/svm flag: exotap uses QEMU TCG"
                .into(),
        }
    }
}

/// Classifies from what the host shows: which kvm modules are loaded, the CPU flags line,
/// whether `/dev/kvm` exists and whether it opened.
pub fn classify(
    modules: &[&str],
    cpu_flags: &str,
    device: bool,
    open: Result<(), String>,
) -> KvmSupport {
    if !device {
        return KvmSupport::NoDevice;
    }
    if modules.contains(&"kvm_pvm") {
        return KvmSupport::Pvm;
    }
    if let Err(why) = open {
        return KvmSupport::NoAccess(why);
    }
    let flags: Vec<&str> = cpu_flags.split_whitespace().collect();
    if modules.contains(&"kvm_intel") || flags.contains(&"vmx") {
        KvmSupport::Hardware(Vendor::Intel)
    } else if modules.contains(&"kvm_amd") || flags.contains(&"svm") {
        KvmSupport::Hardware(Vendor::Amd)
    } else {
        KvmSupport::Unknown
    }
}

/// Looks at this host.
pub fn detect() -> KvmSupport {
    let modules: Vec<&str> = ["kvm_pvm", "kvm_intel", "kvm_amd"]
        .into_iter()
        .filter(|m| Path::new("/sys/module").join(m).exists())
        .collect();
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags = cpuinfo
        .lines()
        .find(|l| l.starts_with("flags"))
        .unwrap_or_default()
        .to_owned();
    let device = Path::new("/dev/kvm").exists();
    let open = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .map(drop)
        .map_err(|e| e.to_string());
    classify(&modules, &flags, device, open)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pvm_module_wins_over_an_openable_device() {
        assert_eq!(
            classify(&["kvm_pvm"], "fpu hypervisor", true, Ok(())),
            KvmSupport::Pvm
        );
        assert!(!KvmSupport::Pvm.usable());
        assert!(KvmSupport::Pvm.explain().contains("kvm_pvm"));
    }

    #[test]
    fn vendor_modules_and_flags_mean_hardware() {
        assert_eq!(
            classify(&["kvm_amd"], "fpu", true, Ok(())),
            KvmSupport::Hardware(Vendor::Amd)
        );
        assert_eq!(
            classify(&[], "fpu vmx sse", true, Ok(())),
            KvmSupport::Hardware(Vendor::Intel)
        );
        assert!(KvmSupport::Hardware(Vendor::Amd).usable());
    }

    #[test]
    fn missing_or_unopenable_device_is_not_usable() {
        assert_eq!(
            classify(&["kvm_amd"], "svm", false, Ok(())),
            KvmSupport::NoDevice
        );
        assert_eq!(
            classify(&["kvm_amd"], "svm", true, Err("Permission denied".into())),
            KvmSupport::NoAccess("Permission denied".into())
        );
        assert_eq!(classify(&[], "fpu sse", true, Ok(())), KvmSupport::Unknown);
    }
}
