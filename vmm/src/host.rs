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

    /// Why exotap's own VMM cannot run here (`None` with hardware KVM): what was found,
    /// without what exotap does instead.
    pub fn reason(&self) -> Option<String> {
        if self.usable() {
            return None;
        }
        let text = self.explain();
        let cause = [
            ": exotap uses QEMU TCG",
            ", so exotap uses QEMU TCG instead",
        ]
        .iter()
        .find_map(|tail| text.find(tail).map(|at| text[..at].to_owned()));
        Some(cause.unwrap_or(text))
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

/// The machine a command asks for (`--backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendRequest {
    /// exotap's own KVM VMM where hardware KVM works and nothing needs QEMU, QEMU otherwise.
    Auto,
    /// exotap's own KVM VMM; refused where it cannot run.
    Kvm,
    /// QEMU.
    Qemu,
}

/// The machine a command runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// exotap's own KVM VMM (vmm/src/kvm).
    Kvm,
    /// QEMU, over its gdbstub.
    Qemu,
}

/// Picks the backend for `request` on a host with `support`. `needs_qemu` names what the
/// command asks for that only QEMU gives (a gdbstub to attach to, host-evaluated trap
/// probes), if anything.
///
/// # Errors
/// `--backend kvm` on a host whose `/dev/kvm` cannot run Linux (the reason is
/// [`KvmSupport::explain`]), or with something only QEMU gives.
pub fn choose(
    request: BackendRequest,
    support: &KvmSupport,
    needs_qemu: Option<&str>,
) -> Result<Backend, String> {
    match request {
        BackendRequest::Qemu => Ok(Backend::Qemu),
        BackendRequest::Kvm if !support.usable() => Err(format!(
            "--backend kvm refused: {} (--backend qemu runs it under QEMU)",
            support.reason().unwrap_or_default()
        )),
        BackendRequest::Kvm => match needs_qemu {
            Some(what) => Err(format!(
                "--backend kvm refused: {what} needs the qemu backend"
            )),
            None => Ok(Backend::Kvm),
        },
        BackendRequest::Auto if support.usable() && needs_qemu.is_none() => Ok(Backend::Kvm),
        BackendRequest::Auto => Ok(Backend::Qemu),
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

/// Whether the CPU flags line says this host is itself a guest (`hypervisor`): its KVM, if
/// any, is nested.
pub fn flags_say_nested(cpu_flags: &str) -> bool {
    cpu_flags.split_whitespace().any(|f| f == "hypervisor")
}

/// Whether this host is itself a guest (see [`flags_say_nested`]).
pub fn nested() -> bool {
    flags_say_nested(&cpu_flags())
}

fn cpu_flags() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    cpuinfo
        .lines()
        .find(|l| l.starts_with("flags"))
        .unwrap_or_default()
        .to_owned()
}

/// Looks at this host.
pub fn detect() -> KvmSupport {
    let modules: Vec<&str> = ["kvm_pvm", "kvm_intel", "kvm_amd"]
        .into_iter()
        .filter(|m| Path::new("/sys/module").join(m).exists())
        .collect();
    let flags = cpu_flags();
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
    fn auto_takes_hardware_kvm_and_qemu_elsewhere() {
        let amd = KvmSupport::Hardware(Vendor::Amd);

        assert_eq!(choose(BackendRequest::Auto, &amd, None), Ok(Backend::Kvm));
        assert_eq!(
            choose(BackendRequest::Auto, &KvmSupport::Pvm, None),
            Ok(Backend::Qemu)
        );
        assert_eq!(
            choose(BackendRequest::Auto, &KvmSupport::NoDevice, None),
            Ok(Backend::Qemu)
        );
        assert_eq!(
            choose(BackendRequest::Auto, &amd, Some("--target")),
            Ok(Backend::Qemu)
        );
    }

    #[test]
    fn kvm_on_pvm_is_refused_naming_kvm_pvm() {
        let refused = choose(BackendRequest::Kvm, &KvmSupport::Pvm, None).unwrap_err();

        assert!(refused.starts_with("--backend kvm refused: "), "{refused}");
        assert!(refused.contains("kvm_pvm"), "{refused}");
        assert!(
            refused.contains("cannot run an unmodified Linux kernel"),
            "{refused}"
        );
    }

    #[test]
    fn kvm_with_what_only_qemu_gives_is_refused_naming_it() {
        let amd = KvmSupport::Hardware(Vendor::Intel);

        assert_eq!(choose(BackendRequest::Kvm, &amd, None), Ok(Backend::Kvm));
        assert_eq!(
            choose(BackendRequest::Kvm, &amd, Some("--target (a gdbstub)")),
            Err("--backend kvm refused: --target (a gdbstub) needs the qemu backend".into())
        );
        assert_eq!(choose(BackendRequest::Qemu, &amd, None), Ok(Backend::Qemu));
    }

    #[test]
    fn hypervisor_flag_means_nested() {
        assert!(flags_say_nested("fpu vme svm hypervisor lahf_lm"));
        assert!(!flags_say_nested("fpu vme svm lahf_lm"));
        assert!(!flags_say_nested("fpu hypervisor_x"));
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
