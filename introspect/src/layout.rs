//! Where the running kernel's pieces are once the KASLR slide is known: its text and end, the
//! PMD page that maps the image, `init_task`, the per-CPU areas and each CPU's current task.

use crate::memory::PhysicalMemory;
use crate::paging::{AddressSpace, PagingError};
use crate::symbols::{slide_addr, SymbolTable};

/// Most CPUs an x86-64 kernel supports (CONFIG_NR_CPUS with MAXSMP).
pub const MAX_CPUS: usize = 8192;
/// Bytes of `task_struct::comm` (TASK_COMM_LEN).
pub const TASK_COMM_LEN: usize = 16;

/// Why the layout could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    /// A symbol the layout needs is missing.
    #[error("the kernel's symbols have no {0}")]
    MissingSymbol(&'static str),
    /// Guest memory behind a kernel variable could not be read.
    #[error("reading {what} at {addr:#x} failed")]
    Read {
        /// Which variable.
        what: &'static str,
        /// Its virtual address.
        addr: u64,
        /// The cause.
        #[source]
        source: PagingError,
    },
    /// The image mapping has no PMD page (not mapped, or mapped by a 1 GiB page).
    #[error("no PMD page maps the kernel image at {addr:#x}")]
    ImagePmd {
        /// The address walked.
        addr: u64,
        /// The cause.
        #[source]
        source: PagingError,
    },
    /// `_text` and `_end` are mapped through different PMD pages.
    #[error("_text and _end are mapped by different PMD pages ({text:#x} and {end:#x})")]
    ImageSplitAcrossPmdPages {
        /// PMD page of `_text`.
        text: u64,
        /// PMD page of `_end`.
        end: u64,
    },
    /// `nr_cpu_ids` is not a possible CPU count.
    #[error("nr_cpu_ids is {0}, not between 1 and {MAX_CPUS}")]
    BadCpuCount(u32),
    /// A CPU number past `nr_cpu_ids`.
    #[error("there is no CPU {cpu} (nr_cpu_ids is {count})")]
    NoCpu {
        /// The CPU asked for.
        cpu: usize,
        /// How many there are.
        count: usize,
    },
}

/// The running kernel's layout (virtual addresses already slid).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelLayout {
    /// The virtual KASLR slide.
    pub slide: u64,
    /// `[_text, _etext)`.
    pub text: (u64, u64),
    /// `_end`.
    pub end: u64,
    /// Guest-physical address of the PMD page that maps `[_text, _end)`.
    pub image_pmd_page: u64,
    /// `init_task`.
    pub init_task: u64,
    /// `__per_cpu_offset[0..nr_cpu_ids]`: each CPU's per-CPU base (its kernel GS base).
    pub per_cpu_offsets: Vec<u64>,
    /// Per-CPU offset of the current-task pointer (`current_task`, or `pcpu_hot` whose first
    /// member it is since 6.2).
    pub current_task_offset: u64,
}

/// Where `pid` and `comm` are inside `task_struct`: from BTF or DWARF, which the caller has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskOffsets {
    /// Byte offset of `pid` (an `i32`).
    pub pid: u64,
    /// Byte offset of `comm` (`char[16]`).
    pub comm: u64,
}

/// What identifies a task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskInfo {
    /// Address of its `task_struct`.
    pub task: u64,
    /// Its pid (the thread id).
    pub pid: i32,
    /// Its command name.
    pub comm: String,
}

impl KernelLayout {
    /// Reads the layout of the kernel whose link-time `symbols` run at `slide`.
    ///
    /// # Errors
    /// [`LayoutError::MissingSymbol`], [`LayoutError::Read`] when `_text` is not mapped at
    /// `slide` or a variable cannot be read, [`LayoutError::ImagePmd`],
    /// [`LayoutError::ImageSplitAcrossPmdPages`], [`LayoutError::BadCpuCount`].
    pub fn read<M: PhysicalMemory + ?Sized>(
        space: &mut AddressSpace<'_, M>,
        symbols: &SymbolTable,
        slide: u64,
    ) -> Result<Self, LayoutError> {
        let addr = |name: &'static str| {
            symbols
                .get(name)
                .map(|s| slide_addr(s.addr, slide))
                .ok_or(LayoutError::MissingSymbol(name))
        };
        let text = (addr("_text")?, addr("_etext")?);
        let end = addr("_end")?;
        space
            .translate(text.0)
            .map_err(|source| LayoutError::Read {
                what: "_text",
                addr: text.0,
                source,
            })?;
        let pmd_page = |space: &mut AddressSpace<'_, M>, addr: u64| {
            space
                .pmd_slot(addr)
                .map(|slot| slot.pmd_page)
                .map_err(|source| LayoutError::ImagePmd { addr, source })
        };
        let image_pmd_page = pmd_page(space, text.0)?;
        let end_pmd_page = pmd_page(space, end.saturating_sub(1))?;
        if image_pmd_page != end_pmd_page {
            return Err(LayoutError::ImageSplitAcrossPmdPages {
                text: image_pmd_page,
                end: end_pmd_page,
            });
        }
        let nr_cpu_ids_addr = addr("nr_cpu_ids")?;
        let nr_cpu_ids = space
            .read_u32(nr_cpu_ids_addr)
            .map_err(|source| LayoutError::Read {
                what: "nr_cpu_ids",
                addr: nr_cpu_ids_addr,
                source,
            })?;
        let count = usize::try_from(nr_cpu_ids)
            .ok()
            .filter(|n| (1..=MAX_CPUS).contains(n))
            .ok_or(LayoutError::BadCpuCount(nr_cpu_ids))?;
        let offsets_addr = addr("__per_cpu_offset")?;
        let mut raw = vec![0u8; count * 8];
        space
            .read(offsets_addr, &mut raw)
            .map_err(|source| LayoutError::Read {
                what: "__per_cpu_offset",
                addr: offsets_addr,
                source,
            })?;
        let per_cpu_offsets = raw
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
            .collect();
        let current_task_offset = symbols
            .get("current_task")
            .or_else(|| symbols.get("pcpu_hot"))
            .map(|s| s.addr)
            .ok_or(LayoutError::MissingSymbol("current_task"))?;
        Ok(Self {
            slide,
            text,
            end,
            image_pmd_page,
            init_task: addr("init_task")?,
            per_cpu_offsets,
            current_task_offset,
        })
    }

    /// `nr_cpu_ids`.
    pub fn nr_cpu_ids(&self) -> usize {
        self.per_cpu_offsets.len()
    }

    /// The current task of the CPU whose kernel GS base is `gs_base` (see
    /// `X86Registers::kernel_percpu_base`).
    ///
    /// # Errors
    /// [`LayoutError::Read`].
    pub fn current_task_at<M: PhysicalMemory + ?Sized>(
        &self,
        space: &mut AddressSpace<'_, M>,
        gs_base: u64,
    ) -> Result<u64, LayoutError> {
        let addr = gs_base.wrapping_add(self.current_task_offset);
        space.read_u64(addr).map_err(|source| LayoutError::Read {
            what: "current_task",
            addr,
            source,
        })
    }

    /// The current task of CPU `cpu`, through `__per_cpu_offset`.
    ///
    /// # Errors
    /// [`LayoutError::NoCpu`], [`LayoutError::Read`].
    pub fn current_task_of_cpu<M: PhysicalMemory + ?Sized>(
        &self,
        space: &mut AddressSpace<'_, M>,
        cpu: usize,
    ) -> Result<u64, LayoutError> {
        let base = *self.per_cpu_offsets.get(cpu).ok_or(LayoutError::NoCpu {
            cpu,
            count: self.nr_cpu_ids(),
        })?;
        self.current_task_at(space, base)
    }
}

/// Reads a task's pid and command name.
///
/// # Errors
/// [`LayoutError::Read`].
pub fn read_task<M: PhysicalMemory + ?Sized>(
    space: &mut AddressSpace<'_, M>,
    task: u64,
    offsets: TaskOffsets,
) -> Result<TaskInfo, LayoutError> {
    let pid_addr = task.wrapping_add(offsets.pid);
    let pid = space
        .read_u32(pid_addr)
        .map_err(|source| LayoutError::Read {
            what: "task_struct::pid",
            addr: pid_addr,
            source,
        })?;
    let comm_addr = task.wrapping_add(offsets.comm);
    let mut comm = [0u8; TASK_COMM_LEN];
    space
        .read(comm_addr, &mut comm)
        .map_err(|source| LayoutError::Read {
            what: "task_struct::comm",
            addr: comm_addr,
            source,
        })?;
    let len = comm.iter().position(|b| *b == 0).unwrap_or(TASK_COMM_LEN);
    Ok(TaskInfo {
        task,
        pid: pid as i32,
        comm: String::from_utf8_lossy(&comm[..len]).into_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::paging::tests::TableBuilder;
    use crate::paging::{TableLevel, PTE_GLOBAL, PTE_PRESENT, PTE_WRITABLE, SIZE_2M};

    const TEXT: u64 = 0xffff_ffff_8100_0000;
    const SLIDE: u64 = 0x2a00_0000;
    const IMAGE_PHYS: u64 = 0x100_0000;
    const PERCPU: [u64; 2] = [0xffff_8880_7a00_0000, 0xffff_8880_7a20_0000];
    const CURRENT_TASK: u64 = 0x1fb80;
    const OFFSETS: TaskOffsets = TaskOffsets {
        pid: 0x5a0,
        comm: 0x758,
    };

    fn symbols(current_task_name: &str) -> SymbolTable {
        let map = format!(
            "ffffffff81000000 T _text\nffffffff81100000 T _etext\nffffffff81200000 D __per_cpu_offset\n\
             ffffffff81201000 D nr_cpu_ids\nffffffff81300000 D init_task\nffffffff81700000 B _end\n\
             {CURRENT_TASK:016x} A {current_task_name}\n"
        );
        SymbolTable::from_system_map(&map).unwrap()
    }

    /// A guest with the image (8 MiB) mapped by 2 MiB pages and two CPUs: CPU 0 runs
    /// `init_task` ("swapper/0", pid 0), CPU 1 a task at image+0x301000 ("sh", pid 42).
    fn guest(nr_cpu_ids: u32) -> TableBuilder {
        let mut tb = TableBuilder::new(false);
        tb.mem.add_zeroed(IMAGE_PHYS, 4 * SIZE_2M as usize).unwrap();
        for i in 0..4 {
            let flags = PTE_PRESENT | PTE_WRITABLE | PTE_GLOBAL;
            tb.map(
                TEXT + SLIDE + i * SIZE_2M,
                IMAGE_PHYS + i * SIZE_2M,
                TableLevel::Pmd,
                flags,
            );
        }
        let phys = |link: u64| IMAGE_PHYS + (link - TEXT);
        tb.mem
            .write_phys_u64(phys(0xffff_ffff_8120_0000), PERCPU[0])
            .unwrap();
        tb.mem
            .write_phys_u64(phys(0xffff_ffff_8120_0008), PERCPU[1])
            .unwrap();
        tb.mem
            .write_phys(phys(0xffff_ffff_8120_1000), &nr_cpu_ids.to_le_bytes())
            .unwrap();
        let tasks = [
            (0xffff_ffff_8130_0000u64, 0u32, &b"swapper/0"[..]),
            (0xffff_ffff_8130_1000, 42, b"sh"),
        ];
        for (cpu, (task, pid, comm)) in tasks.iter().enumerate() {
            tb.mem
                .write_phys(phys(task + OFFSETS.pid), &pid.to_le_bytes())
                .unwrap();
            tb.mem.write_phys(phys(task + OFFSETS.comm), comm).unwrap();
            let mut area = vec![0u8; 4096];
            area[0xb80..0xb88].copy_from_slice(&(task + SLIDE).to_le_bytes());
            tb.map_data(PERCPU[cpu] + 0x1f000, 0x800_0000 + cpu as u64 * 4096, &area);
        }
        tb
    }

    #[test]
    fn layout_slides_image_symbols_and_finds_pmd_page() {
        let mut tb = guest(2);
        let pmd_page = tb.table_at(TEXT + SLIDE, TableLevel::Pmd);

        let layout = KernelLayout::read(&mut tb.space(), &symbols("current_task"), SLIDE).unwrap();

        assert_eq!(layout.text, (TEXT + SLIDE, 0xffff_ffff_8110_0000 + SLIDE));
        assert_eq!(layout.end, 0xffff_ffff_8170_0000 + SLIDE);
        assert_eq!(layout.init_task, 0xffff_ffff_8130_0000 + SLIDE);
        assert_eq!(layout.image_pmd_page, pmd_page);
    }

    #[test]
    fn layout_reads_per_cpu_offsets_up_to_nr_cpu_ids() {
        let mut tb = guest(2);

        let layout = KernelLayout::read(&mut tb.space(), &symbols("current_task"), SLIDE).unwrap();

        assert_eq!(layout.per_cpu_offsets, PERCPU);
        assert_eq!(layout.current_task_offset, CURRENT_TASK);
    }

    #[test]
    fn current_task_of_each_cpu_reads_pid_and_comm() {
        let mut tb = guest(2);
        let mut space = tb.space();
        let layout = KernelLayout::read(&mut space, &symbols("current_task"), SLIDE).unwrap();

        let cpu0 = layout.current_task_of_cpu(&mut space, 0).unwrap();
        let cpu1 = layout.current_task_at(&mut space, PERCPU[1]).unwrap();

        assert_eq!(cpu0, layout.init_task);
        let info = read_task(&mut space, cpu1, OFFSETS).unwrap();
        assert_eq!((info.pid, info.comm.as_str()), (42, "sh"));
        assert_eq!(
            read_task(&mut space, cpu0, OFFSETS).unwrap().comm,
            "swapper/0"
        );
    }

    #[test]
    fn current_task_offset_falls_back_to_pcpu_hot() {
        let mut tb = guest(2);

        let layout = KernelLayout::read(&mut tb.space(), &symbols("pcpu_hot"), SLIDE).unwrap();

        assert_eq!(layout.current_task_offset, CURRENT_TASK);
    }

    #[test]
    fn layout_refuses_impossible_cpu_count() {
        let mut tb = guest(0x10_0000);

        let err = KernelLayout::read(&mut tb.space(), &symbols("current_task"), SLIDE).unwrap_err();

        assert!(matches!(err, LayoutError::BadCpuCount(0x10_0000)));
    }

    #[test]
    fn current_task_of_cpu_refuses_cpu_past_nr_cpu_ids() {
        let mut tb = guest(1);
        let mut space = tb.space();
        let layout = KernelLayout::read(&mut space, &symbols("current_task"), SLIDE).unwrap();

        let err = layout.current_task_of_cpu(&mut space, 1).unwrap_err();

        assert!(matches!(err, LayoutError::NoCpu { cpu: 1, count: 1 }));
    }

    #[test]
    fn layout_reports_image_not_mapped_at_wrong_slide() {
        let mut tb = guest(2);

        let err = KernelLayout::read(
            &mut tb.space(),
            &symbols("current_task"),
            SLIDE + SIZE_2M * 64,
        )
        .unwrap_err();

        assert!(matches!(err, LayoutError::Read { what: "_text", .. }));
    }

    #[test]
    fn mutated_guest_gives_errors_or_tasks_never_panics() {
        use crate::mutation::{mutate_memory, XorShift};

        let phys = |link: u64| (IMAGE_PHYS + (link - TEXT)) & !0xfff;
        let symbols = symbols("current_task");
        let mut rng = XorShift(0xbb67_ae85_84ca_a73b);
        let mut tasks_read = 0;
        for _ in 0..2000 {
            let mut tb = guest(2);
            let mut hot = tb.table_pages();
            hot.extend([
                phys(0xffff_ffff_8120_0000),
                phys(0xffff_ffff_8120_1000),
                phys(0xffff_ffff_8130_0000),
                phys(0xffff_ffff_8130_1000),
                0x800_0000,
                0x800_1000,
            ]);
            mutate_memory(&mut tb.mem, &mut rng, &hot, 8);
            let mut space = tb.space();

            let Ok(layout) = KernelLayout::read(&mut space, &symbols, SLIDE) else {
                continue;
            };
            for cpu in 0..layout.nr_cpu_ids() {
                if let Ok(task) = layout.current_task_of_cpu(&mut space, cpu) {
                    tasks_read += usize::from(read_task(&mut space, task, OFFSETS).is_ok());
                }
            }
        }

        assert!(tasks_read > 0);
    }
}
