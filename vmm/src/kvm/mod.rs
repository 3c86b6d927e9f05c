//! The `kvm` backend: exotap's own minimal VMM on `/dev/kvm` (kvm-ioctls, vm-memory,
//! linux-loader, vm-superio).
//!
//! It boots a bzImage with the 64-bit boot protocol ([`boot_params`], [`cpu_setup`],
//! [`layout`]): zero page with the e820 map (the patch heap is a memory slot of its own, absent
//! from the map), command line, initramfs; ACPI tables for the vCPUs, the IOAPIC and power-off
//! ([`acpi`]; Debian's cloud kernel has no MP-table parser, but an [`mptable`] is there too
//! for kernels booted with `acpi=off`); CPUID filtered from `KVM_GET_SUPPORTED_CPUID`, XCR0
//! and boot MSRs ([`cpuid`]); KVM's in-kernel irqchip and PIT; two 8250 UARTs and the ACPI
//! PM1 registers ([`devices`]): ttyS0 is the console, ttyS1 the host's go channel. Each vCPU
//! is a thread ([`vcpu`]); the guest under the control interface is a [`KvmMachine`].
//!
//! [`run`] follows the guest protocol exactly as [`crate::qemu::run`] does (same markers,
//! phases, timeouts, [`RunOutcome`]). The guest's `poweroff -f` enters ACPI S5 (a write to
//! PM1a control) and the VM stops at once; so does a reboot (`reboot=k`: the i8042 reset
//! command, or a triple fault). A kernel that halts instead (no ACPI, or `halt`) leaves every
//! CPU in `hlt` with interrupts off, which makes no exit: the run loop pauses the vCPUs to
//! look for that state once the console has been quiet for a while
//! ([`KvmMachine::check_halted`]).

pub mod acpi;
/// The KVM structures the public functions take (e.g. [`cpu_setup::long_mode_sregs`]).
pub use kvm_bindings;
pub mod boot_params;
pub mod cpu_setup;
pub mod cpuid;
pub mod devices;
pub mod layout;
pub mod machine;
pub mod mptable;
pub mod vcpu;

use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvm_bindings::{
    kvm_pit_config, kvm_userspace_memory_region, kvm_xcrs, KVM_MAX_CPUID_ENTRIES,
    KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};
use linux_loader::loader::{bzimage::BzImage, KernelLoader};
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use crate::console::{parse_marker, ConsoleTail, Marker};
use crate::qemu::{PatchHeapRange, PhaseHook, RunOutcome, Timeouts};
pub use machine::KvmMachine;
use machine::VcpuHandle;
pub use machine::NESTED_TRAPS_REFUSED;
use vcpu::{VcpuShared, VmEvent};

/// How long the console must be quiet before the run loop looks for a halted guest, and how
/// often it looks then (each look pauses and resumes the vCPUs).
const HALT_CHECK_QUIET: Duration = Duration::from_millis(500);
const HALT_CHECK_EVERY: Duration = Duration::from_secs(1);
/// How long past its total timeout a run may go on before [`watchdog`] ends the process.
const WATCHDOG_GRACE: Duration = Duration::from_secs(60);

/// Where KVM wants its TSS on VMX (three pages below 4 GiB, out of the way of RAM).
const TSS_ADDR: usize = 0xfffb_d000;

/// Errors of the kvm backend.
#[derive(Debug, thiserror::Error)]
pub enum KvmError {
    /// The host cannot run exotap's VMM.
    #[error("the kvm backend cannot run here: {0}")]
    Unsupported(String),
    /// A KVM ioctl failed.
    #[error("{what} failed")]
    Kvm {
        /// The step.
        what: &'static str,
        /// The cause.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// Guest memory could not be set up.
    #[error("cannot set up guest memory")]
    Memory(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The layout is impossible.
    #[error(transparent)]
    Layout(#[from] layout::LayoutError),
    /// The zero page is impossible.
    #[error(transparent)]
    BootParams(#[from] boot_params::BootParamsError),
    /// The MP table is impossible.
    #[error(transparent)]
    MpTable(#[from] mptable::MpTableError),
    /// The ACPI tables are impossible.
    #[error(transparent)]
    Acpi(#[from] acpi::AcpiError),
    /// A file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The kernel could not be loaded.
    #[error("cannot load the kernel {path}: {message}")]
    Load {
        /// The bzImage.
        path: PathBuf,
        /// linux-loader's error.
        message: String,
    },
    /// A vCPU thread could not be started.
    #[error("cannot start vCPU {0}'s thread")]
    Thread(u32, #[source] std::io::Error),
    /// The kick signal's handler could not be installed.
    #[error("cannot install the vCPU kick signal handler: {0}")]
    Signal(String),
    /// The guest did not print `EXOTAP-READY` in time.
    #[error(
        "the guest did not reach EXOTAP-READY within {secs} s; last console lines:\n{tail}\nwhere it was:\n{vcpus}"
    )]
    BootTimeout {
        /// The timeout.
        secs: u64,
        /// The last console lines.
        tail: String,
        /// Each vCPU's state and registers, the UARTs' ([`KvmMachine::stuck_report`]).
        vcpus: String,
    },
    /// The guest did not print `EXOTAP-DONE` in time.
    #[error(
        "the guest did not finish within {secs} s; last console lines:\n{tail}\nwhere it was:\n{vcpus}"
    )]
    RunTimeout {
        /// The timeout.
        secs: u64,
        /// The last console lines.
        tail: String,
        /// Each vCPU's state and registers, the UARTs' ([`KvmMachine::stuck_report`]).
        vcpus: String,
    },
    /// The VM stopped before the guest printed `EXOTAP-DONE`.
    #[error(
        "the VM stopped ({why}) before the guest printed EXOTAP-DONE; last console lines:\n{tail}"
    )]
    Died {
        /// Why.
        why: String,
        /// The last console lines.
        tail: String,
    },
    /// The host's work at a wait point failed.
    #[error("the host's work at phase {phase} failed: {message}")]
    Hook {
        /// The phase.
        phase: String,
        /// What went wrong.
        message: String,
    },
    /// The go byte could not be sent.
    #[error("cannot send the go byte for phase {phase}: {message}")]
    Go {
        /// The phase.
        phase: String,
        /// Why.
        message: String,
    },
    /// Writing the console copy failed.
    #[error("cannot write the console output")]
    Sink(#[source] std::io::Error),
}

fn kvm_err(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> KvmError {
    move |source| KvmError::Kvm { what, source }
}

/// How to run the guest.
#[derive(Debug, Clone)]
pub struct KvmConfig {
    /// The bzImage.
    pub kernel: PathBuf,
    /// The initramfs.
    pub initrd: PathBuf,
    /// Guest memory in MiB, the patch heap included.
    pub memory_mib: u64,
    /// Number of vCPUs.
    pub cpus: u32,
    /// The patch heap: the top of guest memory, a slot of its own, not in the e820 map.
    pub patch_heap: PatchHeapRange,
    /// Phases at which the guest waits for the host (`all` for every phase).
    pub hold: Vec<String>,
    /// Make the guest wait at phase `attach` after `EXOTAP-READY`.
    pub attach_point: bool,
    /// With `attach_point`: the job itself waits at `attach` and `detach` (`exotap.attach=job`).
    pub attach_in_job: bool,
    /// Keep KASLR on.
    pub kaslr: bool,
    /// Extra kernel parameters.
    pub append: Vec<String>,
}

impl KvmConfig {
    /// The defaults: 1 GiB, 2 vCPUs, a 64 MiB patch heap, KASLR on.
    ///
    /// # Errors
    /// Never for the defaults; kept fallible as [`PatchHeapRange::place`] is.
    pub fn new(kernel: PathBuf, initrd: PathBuf) -> Result<Self, crate::qemu::QemuError> {
        let memory_mib = 1024;
        Ok(Self {
            kernel,
            initrd,
            memory_mib,
            cpus: 2,
            patch_heap: PatchHeapRange::place(memory_mib << 20, 64 << 20)?,
            hold: Vec::new(),
            attach_point: false,
            attach_in_job: false,
            kaslr: true,
            append: Vec::new(),
        })
    }

    /// The kernel command line: the QEMU path's parameters without `memmap=` (the heap is not
    /// RAM here), plus what a machine without ACPI, PCI or a real keyboard controller wants.
    pub fn cmdline(&self) -> String {
        let mut params: Vec<String> = [
            "console=ttyS0,115200",
            "panic=-1",
            "quiet",
            "reboot=k",
            "pci=off",
            "no_timer_check",
            crate::qemu::CRYPTO_SELFTESTS_OFF,
            "i8042.noaux",
            "i8042.nomux",
            "i8042.dumbkbd",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        if !self.kaslr {
            params.push("nokaslr".into());
        }
        if self.attach_point && self.attach_in_job {
            params.push("exotap.attach=job".into());
        } else if self.attach_point {
            params.push("exotap.attach=1".into());
        }
        if !self.hold.is_empty() {
            params.push(format!("exotap.hold={}", self.hold.join(",")));
        }
        params.extend(self.append.iter().cloned());
        params.join(" ")
    }
}

/// What the host does at an `EXOTAP-WAIT` marker, with the paused-or-running guest at hand.
pub trait KvmPhaseHook {
    /// Called when the guest waits at `phase`; it resumes (go byte) once this returns `Ok`.
    /// A hook that pauses the machine must resume it.
    ///
    /// # Errors
    /// A message that stops the run.
    fn at_wait(&mut self, phase: &str, machine: &mut KvmMachine) -> Result<(), String>;

    /// Called when the guest prints `EXOTAP-READY` (its kernel is up).
    ///
    /// # Errors
    /// A message that stops the run.
    fn ready(&mut self, machine: &mut KvmMachine) -> Result<(), String> {
        let _ = machine;
        Ok(())
    }

    /// Called about every 20 ms while the guest runs (e.g. to stream trace records, which the
    /// host reads from guest memory without pausing).
    ///
    /// # Errors
    /// A message that stops the run.
    fn tick(&mut self, machine: &mut KvmMachine) -> Result<(), String> {
        let _ = machine;
        Ok(())
    }
}

/// A [`PhaseHook`] of the QEMU path used as a [`KvmPhaseHook`] (it does not see the machine).
#[derive(Debug)]
pub struct Plain<H>(pub H);

impl<H: PhaseHook> KvmPhaseHook for Plain<H> {
    fn at_wait(&mut self, phase: &str, _machine: &mut KvmMachine) -> Result<(), String> {
        self.0.at_wait(phase).map_err(|e| e.to_string())
    }
}

/// Checks that this host's `/dev/kvm` can run the VMM.
///
/// # Errors
/// [`KvmError::Unsupported`] with [`crate::host::KvmSupport::explain`].
pub fn check_host() -> Result<(), KvmError> {
    let support = crate::host::detect();
    if support.usable() {
        Ok(())
    } else {
        Err(KvmError::Unsupported(support.explain()))
    }
}

fn register_slots(
    vm: &VmFd,
    memory: &GuestMemoryMmap,
    slots: &[(u64, u64)],
) -> Result<(), KvmError> {
    for (index, (start, size)) in slots.iter().enumerate() {
        let host = memory
            .get_host_address(GuestAddress(*start))
            .map_err(|e| KvmError::Memory(Box::new(e)))?;
        let region = kvm_userspace_memory_region {
            slot: index as u32,
            flags: 0,
            guest_phys_addr: *start,
            memory_size: *size,
            userspace_addr: host as u64,
        };
        // SAFETY: `host` maps `size` bytes of the VMM's guest memory at `start`, which lives in
        // the `Arc<GuestMemoryMmap>` the machine keeps for as long as the VM exists.
        unsafe { vm.set_user_memory_region(region) }
            .map_err(kvm_err("KVM_SET_USER_MEMORY_REGION"))?;
    }
    Ok(())
}

fn write(memory: &GuestMemoryMmap, addr: u64, bytes: &[u8]) -> Result<(), KvmError> {
    memory
        .write_slice(bytes, GuestAddress(addr))
        .map_err(|e| KvmError::Memory(Box::new(e)))
}

/// The guest's memory: one memfd holding every slot back to back, mapped shared, so that a
/// control-socket client can map the same pages ([`crate::control::SharedRegion`]) and read
/// rings and maps with no request. Anonymous memory where memfd_create(2) is refused.
fn guest_memory(slots: &[(u64, u64)]) -> Result<GuestMemoryMmap, KvmError> {
    let total: u64 = slots.iter().map(|(_, n)| n).sum();
    let file = memfd("exotap-guest-ram").and_then(|f| f.set_len(total).map(|()| f));
    match file {
        Ok(file) => {
            let file = std::sync::Arc::new(file);
            let mut offset = 0u64;
            let ranges: Vec<(GuestAddress, usize, Option<FileOffset>)> = slots
                .iter()
                .map(|(s, n)| {
                    let at = FileOffset::from_arc(std::sync::Arc::clone(&file), offset);
                    offset += n;
                    (GuestAddress(*s), *n as usize, Some(at))
                })
                .collect();
            GuestMemoryMmap::from_ranges_with_files(&ranges)
                .map_err(|e| KvmError::Memory(Box::new(e)))
        }
        Err(e) => {
            tracing::warn!(
                "guest RAM in anonymous memory (memfd: {e}): control-socket clients will read it \
                 through the socket"
            );
            let ranges: Vec<(GuestAddress, usize)> = slots
                .iter()
                .map(|(s, n)| (GuestAddress(*s), *n as usize))
                .collect();
            GuestMemoryMmap::from_ranges(&ranges).map_err(|e| KvmError::Memory(Box::new(e)))
        }
    }
}

/// A new memfd (close-on-exec) named `name`.
fn memfd(name: &str) -> std::io::Result<std::fs::File> {
    let name = std::ffi::CString::new(name).map_err(std::io::Error::other)?;
    // SAFETY: `name` is a valid NUL-terminated string; memfd_create returns a new descriptor
    // or -1, and a new descriptor is owned by nothing else.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nothing else.
    Ok(unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

/// Guest memory as [`boot`] lays it out before it creates the vCPUs: kernel, initramfs, zero
/// page, command line, page tables, GDT, MP and ACPI tables. Needs no `/dev/kvm`.
#[derive(Debug)]
pub struct LoadedGuest {
    memory: GuestMemoryMmap,
    /// Where the protected-mode kernel was loaded (the 64-bit entry is 0x200 past it).
    pub kernel_load: u64,
    /// The zero page (`%rsi` at entry).
    pub zero_page: u64,
}

impl LoadedGuest {
    /// `len` bytes of guest-physical memory at `addr`, or `None` outside guest memory.
    pub fn read(&self, addr: u64, len: usize) -> Option<Vec<u8>> {
        let mut buf = vec![0u8; len];
        self.memory
            .read_slice(&mut buf, GuestAddress(addr))
            .ok()
            .map(|()| buf)
    }
}

/// Lays out guest memory for `config` as the VMM does, without KVM (for tests and inspection).
///
/// # Errors
/// An impossible layout, unreadable files, a kernel that is not a 64-bit bzImage.
pub fn load_memory(config: &KvmConfig) -> Result<LoadedGuest, KvmError> {
    let layout = layout::MemoryLayout::new(config.memory_mib, config.patch_heap)?;
    let memory = guest_memory(&layout.slots())?;
    let kernel_load = load_guest(config, &memory, &layout)?;
    Ok(LoadedGuest {
        memory,
        kernel_load,
        zero_page: layout::ZERO_PAGE_ADDR,
    })
}

/// Loads the kernel, the initramfs and the boot structures; returns the kernel's load address.
fn load_guest(
    config: &KvmConfig,
    memory: &GuestMemoryMmap,
    layout: &layout::MemoryLayout,
) -> Result<u64, KvmError> {
    let read_err = |path: &PathBuf| {
        let path = path.clone();
        move |source| KvmError::Read { path, source }
    };
    let mut kernel = File::open(&config.kernel).map_err(read_err(&config.kernel))?;
    let loaded = BzImage::load(
        memory,
        Some(GuestAddress(layout::KERNEL_ADDR)),
        &mut kernel,
        None,
    )
    .map_err(|e| KvmError::Load {
        path: config.kernel.clone(),
        message: e.to_string(),
    })?;
    let hdr = loaded.setup_header.ok_or_else(|| KvmError::Load {
        path: config.kernel.clone(),
        message: "no setup header".into(),
    })?;
    boot_params::check_header(&hdr)?;

    let initrd = std::fs::read(&config.initrd).map_err(read_err(&config.initrd))?;
    let initrd_addr = layout.initrd_addr(
        initrd.len() as u64,
        u64::from(hdr.initrd_addr_max),
        loaded.kernel_end,
    )?;
    write(memory, initrd_addr, &initrd)?;

    let cmdline = config.cmdline();
    let mut cmdline_bytes = cmdline.clone().into_bytes();
    cmdline_bytes.push(0);
    if cmdline_bytes.len() > layout::CMDLINE_MAX {
        return Err(boot_params::BootParamsError::CmdlineTooLong {
            len: cmdline.len(),
            max: layout::CMDLINE_MAX as u32 - 1,
        }
        .into());
    }
    write(memory, layout::CMDLINE_ADDR, &cmdline_bytes)?;

    let params = boot_params::build(
        &hdr,
        &boot_params::BootInputs {
            cmdline_addr: layout::CMDLINE_ADDR,
            cmdline_len: cmdline.len(),
            initrd: Some((initrd_addr, initrd.len() as u64)),
            e820: layout.e820(),
            acpi_rsdp: Some(acpi::ACPI_ADDR),
        },
    )?;
    write(memory, layout::ZERO_PAGE_ADDR, boot_params::bytes(&params))?;
    for (addr, table) in cpu_setup::identity_page_tables() {
        write(memory, addr, &table)?;
    }
    write(memory, layout::GDT_ADDR, &cpu_setup::gdt_bytes())?;
    write(memory, layout::IDT_ADDR, &[0u8; 8])?;
    write(memory, layout::MPTABLE_ADDR, &mptable::build(config.cpus)?)?;
    for (addr, table) in acpi::build(config.cpus)? {
        write(memory, addr, &table)?;
    }
    tracing::debug!(
        cmdline,
        initrd_addr = format_args!("{initrd_addr:#x}"),
        kernel_end = format_args!("{:#x}", loaded.kernel_end),
        "kvm guest loaded"
    );
    Ok(loaded.kernel_load.0)
}

/// LVT0 (ExtINT from the PIC) and LVT1 (NMI), as firecracker's `set_lint`.
fn set_lint(fd: &VcpuFd) -> Result<(), KvmError> {
    let mut lapic = fd.get_lapic().map_err(kvm_err("KVM_GET_LAPIC"))?;
    let mut set = |offset: usize, mode: u32| {
        let at = offset;
        let bytes: Vec<u8> = lapic.regs[at..at + 4].iter().map(|b| *b as u8).collect();
        let old = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        let new = (old & !0x700) | (mode << 8);
        for (i, b) in new.to_le_bytes().iter().enumerate() {
            lapic.regs[at + i] = *b as _;
        }
    };
    set(0x350, 0x7); // LVT0: ExtINT
    set(0x360, 0x4); // LVT1: NMI
    fd.set_lapic(&lapic).map_err(kvm_err("KVM_SET_LAPIC"))
}

fn configure_vcpu(
    kvm: &Kvm,
    fd: &VcpuFd,
    id: u32,
    count: u32,
    kernel_load: u64,
) -> Result<(), KvmError> {
    let mut cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(kvm_err("KVM_GET_SUPPORTED_CPUID"))?;
    let tsc_deadline = kvm.check_extension(Cap::TscDeadlineTimer);
    cpuid::filter(cpuid.as_mut_slice(), id, count, tsc_deadline);
    fd.set_cpuid2(&cpuid).map_err(kvm_err("KVM_SET_CPUID2"))?;
    if let Some(xcr0) = cpuid::full_xcr0(cpuid.as_slice()) {
        let mut xcrs = kvm_xcrs {
            nr_xcrs: 1,
            ..Default::default()
        };
        xcrs.xcrs[0].value = xcr0;
        fd.set_xcrs(&xcrs).map_err(kvm_err("KVM_SET_XCRS"))?;
    }
    let msrs = kvm_bindings::Msrs::from_entries(&cpuid::boot_msrs())
        .map_err(|e| KvmError::Memory(format!("MSR list: {e:?}").into()))?;
    let set = fd.set_msrs(&msrs).map_err(kvm_err("KVM_SET_MSRS"))?;
    if set != msrs.as_slice().len() {
        // KVM stops at the first MSR it refuses; the rest keep their reset values.
        let refused = msrs
            .as_slice()
            .get(set)
            .map(|m| m.index)
            .unwrap_or_default();
        tracing::warn!("vCPU {id}: KVM refused MSR {refused:#x}; later boot MSRs not set");
    }
    set_lint(fd)?;
    if id == 0 {
        let mut sregs = fd.get_sregs().map_err(kvm_err("KVM_GET_SREGS"))?;
        cpu_setup::long_mode_sregs(&mut sregs);
        fd.set_sregs(&sregs).map_err(kvm_err("KVM_SET_SREGS"))?;
        fd.set_regs(&cpu_setup::boot_regs(kernel_load))
            .map_err(kvm_err("KVM_SET_REGS"))?;
        fd.set_fpu(&cpu_setup::boot_fpu())
            .map_err(kvm_err("KVM_SET_FPU"))?;
    }
    Ok(())
}

/// Creates the VM, loads the guest and starts its vCPUs. Returns the machine and the
/// console's byte stream.
///
/// # Errors
/// A host without usable KVM, unreadable files, a failing ioctl.
pub fn boot(config: &KvmConfig) -> Result<(KvmMachine, Receiver<Vec<u8>>), KvmError> {
    let layout = layout::MemoryLayout::new(config.memory_mib, config.patch_heap)?;
    let kvm = Kvm::new().map_err(kvm_err("opening /dev/kvm"))?;
    if !kvm.check_extension(Cap::ImmediateExit) || !kvm.check_extension(Cap::Irqchip) {
        return Err(KvmError::Unsupported(
            "this KVM lacks KVM_CAP_IMMEDIATE_EXIT or KVM_CAP_IRQCHIP".into(),
        ));
    }
    let vm = kvm.create_vm().map_err(kvm_err("KVM_CREATE_VM"))?;
    vm.set_tss_address(TSS_ADDR)
        .map_err(kvm_err("KVM_SET_TSS_ADDR"))?;
    vm.create_irq_chip()
        .map_err(kvm_err("KVM_CREATE_IRQCHIP"))?;
    vm.create_pit2(kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    })
    .map_err(kvm_err("KVM_CREATE_PIT2"))?;

    let slots = layout.slots();
    let memory = Arc::new(guest_memory(&slots)?);
    register_slots(&vm, &memory, &slots)?;
    let kernel_load = load_guest(config, &memory, &layout)?;

    let (console_tx, console_rx) = mpsc::channel();
    let irq = |gsi: u32| -> Result<EventFd, KvmError> {
        let evt = EventFd::new(libc::EFD_NONBLOCK).map_err(|e| KvmError::Memory(Box::new(e)))?;
        vm.register_irqfd(&evt, gsi).map_err(kvm_err("KVM_IRQFD"))?;
        evt.try_clone().map_err(|e| KvmError::Memory(Box::new(e)))
    };
    let devices = Arc::new(Mutex::new(devices::Devices::new(
        irq(devices::COM1_IRQ)?,
        irq(devices::COM2_IRQ)?,
        console_tx,
    )));

    vcpu::install_kick_handler().map_err(KvmError::Signal)?;
    let (events_tx, events_rx) = mpsc::channel::<VmEvent>();
    let mut fds = Vec::new();
    for id in 0..config.cpus {
        let fd = vm
            .create_vcpu(u64::from(id))
            .map_err(kvm_err("KVM_CREATE_VCPU"))?;
        configure_vcpu(&kvm, &fd, id, config.cpus, kernel_load)?;
        fds.push(fd);
    }
    let mut handles = Vec::new();
    let mut threads = Vec::new();
    for (id, fd) in fds.into_iter().enumerate() {
        let shared = Arc::new(VcpuShared::new(id as u32));
        let thread = std::thread::Builder::new()
            .name(format!("vcpu{id}"))
            .spawn({
                let shared = Arc::clone(&shared);
                let devices = Arc::clone(&devices);
                let events = events_tx.clone();
                move || vcpu::vcpu_loop(fd, shared, devices, events)
            })
            .map_err(|e| KvmError::Thread(id as u32, e))?;
        handles.push(VcpuHandle {
            shared,
            pthread: std::os::unix::thread::JoinHandleExt::as_pthread_t(&thread),
        });
        threads.push(thread);
    }
    Ok((
        KvmMachine::new(memory, handles, threads, events_rx, devices, vm),
        console_rx,
    ))
}

/// Splits the console's byte stream into lines.
#[derive(Debug, Default)]
struct LineBuffer(Vec<u8>);

impl LineBuffer {
    fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.0.extend_from_slice(bytes);
        let mut lines = Vec::new();
        while let Some(at) = self.0.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.0.drain(..=at).collect();
            let text = String::from_utf8_lossy(&line);
            lines.push(text.trim_end_matches(['\n', '\r']).to_owned());
        }
        lines
    }

    fn rest(&mut self) -> Option<String> {
        if self.0.is_empty() {
            return None;
        }
        let text = String::from_utf8_lossy(&self.0)
            .trim_end_matches('\r')
            .to_owned();
        self.0.clear();
        Some(text)
    }
}

/// The guest protocol as the console shows it.
struct Follow<'a> {
    start: Instant,
    ready: bool,
    done: Option<i32>,
    tail: &'a mut ConsoleTail,
    outcome: &'a mut RunOutcome,
}

impl Follow<'_> {
    fn line(
        &mut self,
        line: &str,
        console: &mut dyn Write,
        hook: &mut dyn KvmPhaseHook,
        machine: &mut KvmMachine,
    ) -> Result<(), KvmError> {
        writeln!(console, "{line}").map_err(KvmError::Sink)?;
        self.tail.push(line);
        match parse_marker(line) {
            Some(Marker::Ready) => {
                self.ready = true;
                self.outcome.ready_after = self.start.elapsed();
                hook.ready(machine).map_err(|message| KvmError::Hook {
                    phase: "ready".into(),
                    message,
                })?;
            }
            Some(Marker::Phase(name)) => self.outcome.phases.push((name, self.start.elapsed())),
            Some(Marker::Wait(phase)) => {
                console.flush().map_err(KvmError::Sink)?;
                hook.at_wait(&phase, machine)
                    .map_err(|message| KvmError::Hook {
                        phase: phase.clone(),
                        message,
                    })?;
                machine
                    .send_go(b"g")
                    .map_err(|message| KvmError::Go { phase, message })?;
            }
            Some(Marker::Result { key, value }) => self.outcome.results.push((key, value)),
            Some(Marker::Done(rc)) => self.done = Some(rc),
            Some(Marker::Go(_)) | None => {}
        }
        Ok(())
    }
}

/// Boots the guest under KVM and runs it to completion: copies every console line to
/// `console`, answers waits with `hook`, and returns when the guest resets after
/// `EXOTAP-DONE`.
///
/// # Errors
/// No usable KVM, boot failures, a timeout (the error shows the last console lines), a VM
/// that stops before the guest is done.
pub fn run(
    config: &KvmConfig,
    timeouts: Timeouts,
    console: &mut dyn Write,
    hook: &mut dyn KvmPhaseHook,
) -> Result<RunOutcome, KvmError> {
    check_host()?;
    let start = Instant::now();
    let (mut machine, console_rx) = boot(config)?;
    let _watchdog = watchdog(machine.control(), timeouts.total + WATCHDOG_GRACE);
    let mut lines = LineBuffer::default();
    let mut tail = ConsoleTail::new(30);
    let mut outcome = RunOutcome {
        rc: -1,
        results: Vec::new(),
        phases: Vec::new(),
        ready_after: Duration::ZERO,
        wall: Duration::ZERO,
    };
    let mut state = Follow {
        start,
        ready: false,
        done: None,
        tail: &mut tail,
        outcome: &mut outcome,
    };
    let mut quiet_since = Instant::now();
    let mut last_halt_check = Instant::now();
    loop {
        let elapsed = start.elapsed();
        if !state.ready && elapsed > timeouts.boot {
            return Err(KvmError::BootTimeout {
                secs: timeouts.boot.as_secs(),
                tail: state.tail.render(),
                vcpus: machine.stuck_report(),
            });
        }
        if elapsed > timeouts.total {
            return Err(KvmError::RunTimeout {
                secs: timeouts.total.as_secs(),
                tail: state.tail.render(),
                vcpus: machine.stuck_report(),
            });
        }
        if let Ok(bytes) = console_rx.recv_timeout(Duration::from_millis(20)) {
            quiet_since = Instant::now();
            for line in lines.push(&bytes) {
                state.line(&line, console, hook, &mut machine)?;
            }
        }
        if machine.ended().is_none() {
            machine.next_event(Duration::ZERO);
        }
        if machine.ended().is_none() {
            hook.tick(&mut machine).map_err(|message| KvmError::Hook {
                phase: "(running)".into(),
                message,
            })?;
        }
        // A halted guest makes no exit: look for it once the console has been quiet a while
        // after the job's end (each look pauses the vCPUs, which the zero-stop data path of
        // an instrumented job must not see).
        if machine.ended().is_none()
            && state.done.is_some()
            && quiet_since.elapsed() > HALT_CHECK_QUIET
            && last_halt_check.elapsed() > HALT_CHECK_EVERY
        {
            last_halt_check = Instant::now();
            machine.check_halted();
        }
        if machine.ended().is_some() {
            // The vCPU wrote its last console bytes before it reset: they are queued.
            while let Ok(bytes) = console_rx.try_recv() {
                for line in lines.push(&bytes) {
                    state.line(&line, console, hook, &mut machine)?;
                }
            }
            if let Some(line) = lines.rest() {
                state.line(&line, console, hook, &mut machine)?;
            }
            break;
        }
    }
    let done = state.done;
    console.flush().map_err(KvmError::Sink)?;
    let why = match machine.ended() {
        // Where it was, when the run did not end on its own (a triple fault mid-job).
        Some(VmEvent::Reset { vcpu }) if done.is_none() => format!(
            "vCPU {vcpu} reset the machine ({})",
            machine
                .reset_registers(vcpu)
                .unwrap_or_else(|| "its registers could not be read".into())
        ),
        Some(VmEvent::Reset { vcpu }) => format!("vCPU {vcpu} reset the machine"),
        Some(VmEvent::PowerOff { vcpu }) => format!("vCPU {vcpu} powered the machine off"),
        Some(VmEvent::Halted) => "every vCPU halted with interrupts off".into(),
        Some(VmEvent::Failed { vcpu, message }) => format!("vCPU {vcpu}: {message}"),
        _ => "unknown".into(),
    };
    machine.shutdown();
    outcome.wall = start.elapsed();
    match (done, machine.ended()) {
        (Some(rc), Some(VmEvent::Reset { .. } | VmEvent::PowerOff { .. } | VmEvent::Halted)) => {
            tracing::info!("the VM stopped: {why}");
            outcome.rc = rc;
            Ok(outcome)
        }
        _ => Err(KvmError::Died {
            why,
            tail: tail.render(),
        }),
    }
}

/// Ends the process when the run has not returned `limit` after its start: the run loop
/// checks its timeouts between console lines and hook calls, and a hook blocked for good
/// (or a vCPU thread that never parks) would otherwise hold the VM, and whoever waits on
/// exotap, forever. It prints what each vCPU was doing, then exits with status 124 (as
/// `timeout(1)` does); the VM goes with the process. Dropping the returned sender disarms it.
fn watchdog(machine: KvmMachine, limit: Duration) -> mpsc::Sender<()> {
    let (disarm, armed) = mpsc::channel::<()>();
    let spawned = std::thread::Builder::new()
        .name("kvm-watchdog".into())
        .spawn(move || {
            if armed.recv_timeout(limit) != Err(mpsc::RecvTimeoutError::Timeout) {
                return;
            }
            let _ = writeln!(
                std::io::stderr(),
                "exotap: the KVM run did not end {} s after its start ({} s past its \
                 timeout): the host side is blocked; {}; ending the process",
                limit.as_secs(),
                WATCHDOG_GRACE.as_secs(),
                machine.describe_vcpus()
            );
            std::process::exit(124);
        });
    if let Err(e) = spawned {
        tracing::warn!("no watchdog for this run (cannot start its thread: {e})");
    }
    disarm
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_split_on_newline_with_cr_dropped() {
        let mut buf = LineBuffer::default();

        let first = buf.push(b"EXOTAP-RE");
        let second = buf.push(b"ADY\r\nEXOTAP-DONE 0\r\npartial");

        assert!(first.is_empty());
        assert_eq!(second, ["EXOTAP-READY", "EXOTAP-DONE 0"]);
        assert_eq!(buf.rest().as_deref(), Some("partial"));
        assert_eq!(buf.rest(), None);
    }

    #[test]
    fn cmdline_has_console_and_no_memmap() {
        let mut config = KvmConfig::new("bz".into(), "rd".into()).unwrap();
        config.hold = vec!["splice".into()];
        config.kaslr = false;

        let cmdline = config.cmdline();

        assert!(
            cmdline.starts_with("console=ttyS0,115200 panic=-1"),
            "{cmdline}"
        );
        assert!(!cmdline.contains("memmap="), "{cmdline}");
        assert!(cmdline.contains("reboot=k"), "{cmdline}");
        assert!(cmdline.contains("exotap.hold=splice"), "{cmdline}");
        assert!(cmdline.contains("nokaslr"), "{cmdline}");
    }
}
