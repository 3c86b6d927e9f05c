//! `--backend auto|kvm|qemu`: which machine a command runs on (the choice itself is
//! [`exotap_vmm::host::choose`], tested there).

use clap::{Args, ValueEnum};
use exotap_vmm::host::{self, Backend, BackendRequest};
use exotap_vmm::qemu::TcgThreads;

/// Which machine runs the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendChoice {
    /// exotap's own KVM VMM where hardware virtualization works (not kvm_pvm) and nothing
    /// needs QEMU, QEMU otherwise.
    Auto,
    /// exotap's own VMM on /dev/kvm; refused where /dev/kvm cannot run Linux.
    Kvm,
    /// QEMU (over its gdbstub).
    Qemu,
}

impl From<BackendChoice> for BackendRequest {
    fn from(choice: BackendChoice) -> Self {
        match choice {
            BackendChoice::Auto => Self::Auto,
            BackendChoice::Kvm => Self::Kvm,
            BackendChoice::Qemu => Self::Qemu,
        }
    }
}

/// `--tcg-threads single|multi`: how QEMU's TCG runs the vCPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TcgThreadsChoice {
    /// One host thread runs every vCPU in turn: the guest may patch its own text safely.
    Single,
    /// A host thread per vCPU: faster on multi-threaded workloads, but QEMU 7.2 crashes a
    /// guest that patches its own hot text (its kprobes, ftrace, static keys) meanwhile.
    Multi,
}

impl From<TcgThreadsChoice> for TcgThreads {
    fn from(choice: TcgThreadsChoice) -> Self {
        match choice {
            TcgThreadsChoice::Single => Self::Single,
            TcgThreadsChoice::Multi => Self::Multi,
        }
    }
}

/// The machine a command boots: its deadlines, vCPUs and TCG threads (`boot` has its own,
/// with more).
#[derive(Debug, Args, Clone)]
pub struct MachineArgs {
    /// Booting: seconds until the guest must print EXOTAP-READY.
    #[arg(long, default_value_t = 120, value_name = "SECONDS")]
    pub boot_timeout: u64,
    /// Booting: seconds until the guest must finish.
    #[arg(long, default_value_t = 600, value_name = "SECONDS")]
    pub timeout: u64,
    /// Booting: number of vCPUs.
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub cpus: u32,
    /// Booting, QEMU TCG: how many host threads run the vCPUs.
    #[arg(long, value_enum, default_value_t = TcgThreadsChoice::Single, value_name = "MODE")]
    pub tcg_threads: TcgThreadsChoice,
}

/// The backend for `choice` on this host; `needs_qemu` names what the command asks for that
/// only QEMU gives, if anything.
///
/// # Errors
/// `--backend kvm` where this host's `/dev/kvm` cannot run Linux (kvm_pvm, none, no access)
/// or with something only QEMU gives; the message says which.
pub fn resolve(choice: BackendChoice, needs_qemu: Option<&str>) -> anyhow::Result<Backend> {
    let support = host::detect();
    let backend = host::choose(choice.into(), &support, needs_qemu).map_err(anyhow::Error::msg)?;
    if backend == Backend::Qemu && choice == BackendChoice::Auto {
        match needs_qemu {
            Some(what) => tracing::info!("backend qemu: {what} needs it"),
            None => tracing::info!("backend qemu: {}", support.explain()),
        }
    }
    Ok(backend)
}
