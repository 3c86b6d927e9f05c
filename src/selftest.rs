//! `exotap selftest`: proves, on this host, that exotap can see and change a live guest.
//!
//! It boots the Debian guest under QEMU with the gdbstub, and at the guest's wait points:
//! attaches (timing it several times), finds the KASLR slide and layout, maps the patch heap
//! into kernel space next to the image, splices `__x64_sys_getpid`'s entry instruction to a
//! patch that counts, lets the syscall workload run, then restores the original bytes and
//! detaches. The guest reports its own view as oracles: `/proc/kallsyms` addresses, the
//! workload's call count, and the hit count of its own kprobe on the same function
//! (`kprobe_events`/`kprobe_profile`; Debian's kernel lacks CONFIG_FUNCTION_PROFILER). The
//! kprobe sits on the ftrace site, so while it is armed the entry holds `call <ftrace
//! trampoline>` instead of the nop5, and the patch relocates that call.
//!
//! Every host finding is printed as `HOST-RESULT key=value` next to the guest's
//! `EXOTAP-RESULT` lines; the end-to-end test compares the two.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use exotap_guest_images::{self as images, GuestJob};
use exotap_vmm::control::{Machine, VcpuId};
use exotap_vmm::qemu::{self, Accel, PatchHeapRange, PhaseHook, QemuConfig, QemuError, Timeouts};

use crate::attach::{self, Attached, HeapPlaceArg, Survey, Target};
use crate::entry_patch::{counter_patch, jmp_rel32};
use crate::kernel_image::{ImageArgs, KernelImage};
use exotap_probes::live::guest_memory::BackendMemory;

/// The function spliced.
const FUNCTION: &str = "__x64_sys_getpid";
/// The name ftrace and kprobes know it by: `__x64_sys_getpid` and `__do_sys_getpid` share one
/// address in this kernel, and ftrace lists only the latter.
const FTRACE_NAME: &str = "__do_sys_getpid";
/// Offsets inside the patch heap (its first page holds the mapping check's marker).
const COUNTER_OFFSET: u64 = 0x1000;
const PATCH_OFFSET: u64 = 0x2000;

/// Boot a guest and prove attach, KASLR, the patch heap and a splice work here.
#[derive(Debug, Args)]
pub struct SelftestArgs {
    /// getpid calls the workload makes while the splice is in.
    #[arg(long, default_value_t = 20000, value_name = "N")]
    pub calls: u32,
    /// How many times to attach (and find the slide) for the attach-time median.
    #[arg(long, default_value_t = 5, value_name = "N")]
    pub attach_repeats: u32,
    /// Patch heap size in MiB.
    #[arg(long, default_value_t = 64, value_name = "MiB")]
    pub heap_size: u64,
    /// Which side of the kernel image the patch heap goes (`before` tests the place KASLR
    /// forces on a high slide).
    #[arg(long, value_enum, default_value_t = HeapPlaceArg::Auto, value_name = "SIDE")]
    pub heap_place: HeapPlaceArg,
    /// Copy the serial console to FILE instead of stdout.
    #[arg(long, value_name = "FILE")]
    pub console: Option<PathBuf>,
    /// Seconds until the guest must finish.
    #[arg(long, default_value_t = 600, value_name = "SECONDS")]
    pub timeout: u64,
    #[command(flatten)]
    pub image: ImageArgs,
}

/// The guest's side: oracles and the two wait points.
fn job(calls: u32) -> GuestJob {
    GuestJob::from_script(format!(
        r#"set -e
T=/sys/kernel/tracing
sym() {{ awk -v n="$1" '$3==n {{print $1; exit}}' /proc/kallsyms; }}
exotap_result kallsyms._text "$(sym _text)"
exotap_result kallsyms.vfs_read "$(sym vfs_read)"
exotap_result kallsyms.{FUNCTION} "$(sym {FUNCTION})"
echo 'p:exotap/getpid {FTRACE_NAME}' >> $T/kprobe_events
echo 1 > $T/events/exotap/getpid/enable
exotap_wait splice
exotap_phase syscalls
syscall-loop {calls}
exotap_wait unsplice
exotap_result kprobe.{FTRACE_NAME} "$(awk '$1=="getpid" || $1=="exotap/getpid" {{print $2}}' $T/kprobe_profile)"
echo 0 > $T/events/exotap/getpid/enable
echo '-:exotap/getpid' >> $T/kprobe_events
"#
    ))
}

fn report(key: &str, value: impl std::fmt::Display) {
    outln!("HOST-RESULT {key}={value}");
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What the splice left to undo.
struct Splice {
    att: Attached,
    entry: u64,
    original: [u8; 5],
    jump: [u8; 5],
    counter_phys: u64,
}

struct SelftestHook {
    target: Target,
    image: KernelImage,
    heap: PatchHeapRange,
    heap_place: HeapPlaceArg,
    repeats: u32,
    splice: Option<Splice>,
}

impl SelftestHook {
    fn attach_and_survey(&self) -> anyhow::Result<(Attached, Survey)> {
        let mut att = attach::attach(&self.target)?;
        let survey = attach::survey(&mut att, &self.image)?;
        Ok((att, survey))
    }

    fn splice(&mut self) -> anyhow::Result<()> {
        let mut times = Vec::new();
        for _ in 1..self.repeats {
            let (att, survey) = self.attach_and_survey()?;
            times.push(survey.ready_after);
            att.machine.detach()?;
        }
        let (mut att, survey) = self.attach_and_survey()?;
        times.push(survey.ready_after);
        times.sort();
        let ms = |d: &Duration| format!("{:.1}", d.as_secs_f64() * 1e3);
        report(
            "attach_ms",
            times.iter().map(ms).collect::<Vec<_>>().join(","),
        );
        report("attach_ms.median", ms(&times[times.len() / 2]));
        report("symbols.load_ms", ms(&self.image.load_time));
        report("slide", format!("{:#x}", survey.kaslr.slide));
        let slid = |name: &str| -> anyhow::Result<u64> {
            Ok(self.image.address(name)?.wrapping_add(survey.kaslr.slide))
        };
        for name in ["_text", "_end", "vfs_read", FUNCTION] {
            report(&format!("addr.{name}"), format!("{:x}", slid(name)?));
        }
        let m = &mut att.machine;
        let mut vfs_read = [0u8; 5];
        survey
            .space(&mut BackendMemory(&mut *m))
            .read(slid("vfs_read")?, &mut vfs_read)?;
        report("bytes.vfs_read", hex(&vfs_read));

        let plan = attach::map_patch_heap(
            m,
            &survey,
            self.heap_place.into(),
            self.heap.base,
            self.heap.size,
        )?;
        report("heap.va", format!("{:#x}", plan.va));
        report("heap.size", format!("{:#x}", plan.size));
        report("heap.pmd_entries", plan.writes.len());

        // Splice: counter and patch in the heap, then the one entry instruction.
        let entry = slid(FUNCTION)?;
        let mut original = [0u8; 5];
        survey
            .space(&mut BackendMemory(&mut *m))
            .read(entry, &mut original)?;
        report(&format!("bytes.{FUNCTION}.spliced_over"), hex(&original));
        let patch_va = plan.va + PATCH_OFFSET;
        let patch = counter_patch(entry, original, patch_va, plan.va + COUNTER_OFFSET)?;
        m.write_phys(plan.phys + COUNTER_OFFSET, &0u64.to_le_bytes())?;
        m.write_phys(plan.phys + PATCH_OFFSET, &patch)?;
        let jump = jmp_rel32(entry, patch_va)?;
        m.write_virt(VcpuId(0), entry, &jump)?;
        m.resume()?;
        self.splice = Some(Splice {
            att,
            entry,
            original,
            jump,
            counter_phys: plan.phys + COUNTER_OFFSET,
        });
        Ok(())
    }

    fn unsplice(&mut self) -> anyhow::Result<()> {
        let Some(mut s) = self.splice.take() else {
            bail!("the guest reached unsplice without a splice in place");
        };
        let m = &mut s.att.machine;
        m.pause()?;
        let mut now = [0u8; 5];
        m.read_virt(VcpuId(0), s.entry, &mut now)?;
        if now != s.jump {
            bail!(
                "{FUNCTION}'s entry changed under the splice: {} instead of {}",
                hex(&now),
                hex(&s.jump)
            );
        }
        let mut counter = [0u8; 8];
        m.read_phys(s.counter_phys, &mut counter)?;
        m.write_virt(VcpuId(0), s.entry, &s.original)?;
        m.read_virt(VcpuId(0), s.entry, &mut now)?;
        report(&format!("counter.{FUNCTION}"), u64::from_le_bytes(counter));
        report(&format!("bytes.{FUNCTION}.restored"), hex(&now));
        report("restored", if now == s.original { "yes" } else { "no" });
        s.att.machine.detach()?;
        Ok(())
    }
}

impl PhaseHook for SelftestHook {
    fn at_wait(&mut self, phase: &str) -> Result<(), QemuError> {
        let result = match phase {
            "splice" => self.splice(),
            "unsplice" => self.unsplice(),
            _ => Ok(()),
        };
        result.map_err(|e| QemuError::Hook {
            phase: phase.to_owned(),
            message: format!("{e:#}"),
        })
    }
}

/// Runs the self-test; returns the guest job's exit code.
///
/// # Errors
/// When the guest cannot be booted or a step fails (the error names the step).
pub fn run(args: &SelftestArgs) -> anyhow::Result<i32> {
    let image = args.image.load()?;
    let work = tempfile::Builder::new()
        .prefix("exotap-selftest-")
        .tempdir()
        .context("cannot create a working directory")?;
    let initrd = work.path().join("initramfs.cpio.gz");
    images::write_initramfs(&job(args.calls), &initrd).context("cannot build the initramfs")?;
    let mut config = QemuConfig::new(image.path.clone(), initrd)?;
    config.accel = if exotap_vmm::host::detect().usable() {
        Accel::Kvm
    } else {
        Accel::Tcg
    };
    config.patch_heap = PatchHeapRange::place(config.memory_mib << 20, args.heap_size << 20)?;
    let socket = work.path().join("gdb.sock");
    config.gdbstub = Some(format!("unix:{},server=on,wait=off", socket.display()));
    let mut hook = SelftestHook {
        target: Target::new(format!("unix:{}", socket.display())),
        heap: config.patch_heap,
        heap_place: args.heap_place,
        image,
        repeats: args.attach_repeats.max(1),
        splice: None,
    };
    let mut sink: Box<dyn std::io::Write> = match &args.console {
        Some(path) => Box::new(
            std::fs::File::create(path)
                .with_context(|| format!("cannot create {}", path.display()))?,
        ),
        None => Box::new(std::io::stdout()),
    };
    let timeouts = Timeouts {
        boot: Duration::from_secs(120),
        total: Duration::from_secs(args.timeout),
    };
    let outcome = qemu::run(&config, work.path(), timeouts, &mut sink, &mut hook)?;
    drop(sink);
    if args.console.is_some() {
        for (key, value) in &outcome.results {
            outln!("EXOTAP-RESULT {key}={value}");
        }
        outln!("EXOTAP-DONE {}", outcome.rc);
    }
    Ok(outcome.rc)
}
