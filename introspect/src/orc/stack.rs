//! What the unwinder reads from the guest: stack words at guest-virtual addresses, and the
//! kernel's register frames stored on stacks (`struct pt_regs`, the iret frame, and the
//! `struct inactive_task_frame` of a task that is not running).

use crate::memory::PhysicalMemory;
use crate::paging::{AddressSpace, PagingError};

/// Read access to guest-virtual memory, as much as an unwinder needs: one stack word at a
/// time. A live backend implements it over its control interface (or through
/// [`AddressSpace`]), tests and snapshots over bytes in host memory ([`StackSnapshot`]).
pub trait StackMemory {
    /// Why a read failed.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Reads the little-endian `u64` at the guest-virtual address `vaddr`.
    ///
    /// # Errors
    /// When any of the 8 bytes is not readable.
    fn read_u64(&mut self, vaddr: u64) -> Result<u64, Self::Error>;
}

impl<M: StackMemory + ?Sized> StackMemory for &mut M {
    type Error = M::Error;

    fn read_u64(&mut self, vaddr: u64) -> Result<u64, Self::Error> {
        (**self).read_u64(vaddr)
    }
}

impl<M: PhysicalMemory + ?Sized> StackMemory for AddressSpace<'_, M> {
    type Error = PagingError;

    fn read_u64(&mut self, vaddr: u64) -> Result<u64, PagingError> {
        AddressSpace::read_u64(self, vaddr)
    }
}

/// A stack word outside a [`StackSnapshot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{addr:#x} is outside the stack snapshot")]
pub struct OutsideSnapshot {
    /// The address read.
    pub addr: u64,
}

/// Copies of stack regions taken from a stopped guest (or built by a test): each a start
/// address and its bytes.
#[derive(Debug, Clone, Default)]
pub struct StackSnapshot {
    regions: Vec<(u64, Vec<u8>)>,
}

impl StackSnapshot {
    /// A snapshot of one region of `bytes` at `base`.
    pub fn new(base: u64, bytes: Vec<u8>) -> Self {
        Self {
            regions: vec![(base, bytes)],
        }
    }

    /// Adds another region (an IRQ or exception stack, say). Overlaps are allowed; the
    /// first region holding a whole word answers.
    pub fn add_region(&mut self, base: u64, bytes: Vec<u8>) {
        self.regions.push((base, bytes));
    }
}

impl StackMemory for StackSnapshot {
    type Error = OutsideSnapshot;

    fn read_u64(&mut self, vaddr: u64) -> Result<u64, OutsideSnapshot> {
        self.regions
            .iter()
            .find_map(|(base, bytes)| {
                let offset = usize::try_from(vaddr.checked_sub(*base)?).ok()?;
                let word = bytes.get(offset..offset.checked_add(8)?)?;
                Some(u64::from_le_bytes(word.try_into().ok()?))
            })
            .ok_or(OutsideSnapshot { addr: vaddr })
    }
}

/// x86-64 `struct pt_regs` (`arch/x86/include/asm/ptrace.h`): what entry code saves on the
/// stack, in that order, 8 bytes each: r15 at 0 through ss at 160.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[allow(missing_docs)] // The fields are the kernel's names.
pub struct PtRegs {
    pub r15: u64,
    pub r14: u64,
    pub r13: u64,
    pub r12: u64,
    pub bp: u64,
    pub bx: u64,
    pub r11: u64,
    pub r10: u64,
    pub r9: u64,
    pub r8: u64,
    pub ax: u64,
    pub cx: u64,
    pub dx: u64,
    pub si: u64,
    pub di: u64,
    /// The syscall number, or the exception's error code, or -1.
    pub orig_ax: u64,
    pub ip: u64,
    pub cs: u64,
    pub flags: u64,
    pub sp: u64,
    pub ss: u64,
}

impl PtRegs {
    /// `sizeof(struct pt_regs)`.
    pub const SIZE: u64 = 21 * 8;
    /// `offsetof(struct pt_regs, ip)`: where the hardware iret frame starts
    /// (`IRET_FRAME_OFFSET`).
    pub const IRET_FRAME_OFFSET: u64 = 16 * 8;

    /// Reads a `struct pt_regs` at `addr`.
    ///
    /// # Errors
    /// The first failing read, with its address.
    pub fn read<M: StackMemory + ?Sized>(mem: &mut M, addr: u64) -> Result<Self, (u64, M::Error)> {
        let w = read_words::<M, 21>(mem, addr)?;
        Ok(Self {
            r15: w[0],
            r14: w[1],
            r13: w[2],
            r12: w[3],
            bp: w[4],
            bx: w[5],
            r11: w[6],
            r10: w[7],
            r9: w[8],
            r8: w[9],
            ax: w[10],
            cx: w[11],
            dx: w[12],
            si: w[13],
            di: w[14],
            orig_ax: w[15],
            ip: w[16],
            cs: w[17],
            flags: w[18],
            sp: w[19],
            ss: w[20],
        })
    }

    /// The registers in memory order, as [`PtRegs::read`] expects them.
    pub fn to_words(&self) -> [u64; 21] {
        [
            self.r15,
            self.r14,
            self.r13,
            self.r12,
            self.bp,
            self.bx,
            self.r11,
            self.r10,
            self.r9,
            self.r8,
            self.ax,
            self.cx,
            self.dx,
            self.si,
            self.di,
            self.orig_ax,
            self.ip,
            self.cs,
            self.flags,
            self.sp,
            self.ss,
        ]
    }

    /// Whether the registers were saved from user mode (CPL 3 in `cs`).
    pub fn user_mode(&self) -> bool {
        self.cs & 3 != 0
    }
}

/// The hardware iret frame: what the CPU pushes on an interrupt or exception.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[allow(missing_docs)] // The fields are the kernel's names.
pub struct IretFrame {
    pub ip: u64,
    pub cs: u64,
    pub flags: u64,
    pub sp: u64,
    pub ss: u64,
}

impl IretFrame {
    /// `IRET_FRAME_SIZE`.
    pub const SIZE: u64 = 5 * 8;

    /// Reads an iret frame at `addr`.
    ///
    /// # Errors
    /// The first failing read, with its address.
    pub fn read<M: StackMemory + ?Sized>(mem: &mut M, addr: u64) -> Result<Self, (u64, M::Error)> {
        let [ip, cs, flags, sp, ss] = read_words::<M, 5>(mem, addr)?;
        Ok(Self {
            ip,
            cs,
            flags,
            sp,
            ss,
        })
    }

    /// Whether the frame returns to user mode (CPL 3 in `cs`).
    pub fn user_mode(&self) -> bool {
        self.cs & 3 != 0
    }
}

/// x86-64 `struct inactive_task_frame` (Linux 6.1 `arch/x86/include/asm/switch_to.h`): what
/// `__switch_to_asm` pushes before it saves the stack pointer in `task->thread.sp`, lowest
/// address first.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[allow(missing_docs)] // The fields are the kernel's names.
pub struct InactiveTaskFrame {
    pub r15: u64,
    pub r14: u64,
    pub r13: u64,
    pub r12: u64,
    pub bx: u64,
    pub bp: u64,
    /// Where the task resumes: the return site of `__switch_to_asm` in `__schedule`, or
    /// `ret_from_fork` for a task that never ran.
    pub ret_addr: u64,
}

impl InactiveTaskFrame {
    /// `sizeof(struct inactive_task_frame)`.
    pub const SIZE: u64 = 7 * 8;

    /// Reads the frame at `thread_sp` (the task's saved `thread.sp`).
    ///
    /// # Errors
    /// The first failing read, with its address.
    pub fn read<M: StackMemory + ?Sized>(
        mem: &mut M,
        thread_sp: u64,
    ) -> Result<Self, (u64, M::Error)> {
        let [r15, r14, r13, r12, bx, bp, ret_addr] = read_words::<M, 7>(mem, thread_sp)?;
        Ok(Self {
            r15,
            r14,
            r13,
            r12,
            bx,
            bp,
            ret_addr,
        })
    }

    /// The frame in memory order.
    pub fn to_words(&self) -> [u64; 7] {
        [
            self.r15,
            self.r14,
            self.r13,
            self.r12,
            self.bx,
            self.bp,
            self.ret_addr,
        ]
    }
}

/// `N` consecutive words from `addr`. Addresses wrap like the CPU's; the unwinder refuses
/// frames that would wrap before it reads them.
fn read_words<M: StackMemory + ?Sized, const N: usize>(
    mem: &mut M,
    addr: u64,
) -> Result<[u64; N], (u64, M::Error)> {
    let mut words = [0u64; N];
    for (i, word) in (0u64..).zip(words.iter_mut()) {
        let at = addr.wrapping_add(i * 8);
        *word = mem.read_u64(at).map_err(|err| (at, err))?;
    }
    Ok(words)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot_of(base: u64, words: &[u64]) -> StackSnapshot {
        StackSnapshot::new(base, words.iter().flat_map(|w| w.to_le_bytes()).collect())
    }

    #[test]
    fn snapshot_reads_a_word_inside_a_region() {
        let mut stack = snapshot_of(0x1000, &[1, 2, 3]);

        let word = stack.read_u64(0x1008);

        assert_eq!(word, Ok(2));
    }

    #[test]
    fn snapshot_refuses_a_word_across_the_region_end() {
        let mut stack = snapshot_of(0x1000, &[1, 2]);

        let err = stack.read_u64(0x1009);

        assert_eq!(err, Err(OutsideSnapshot { addr: 0x1009 }));
    }

    #[test]
    fn snapshot_refuses_a_word_below_the_region() {
        let mut stack = snapshot_of(0x1000, &[1]);

        let err = stack.read_u64(0xff8);

        assert_eq!(err, Err(OutsideSnapshot { addr: 0xff8 }));
    }

    #[test]
    fn snapshot_refuses_the_top_of_the_address_space() {
        let mut stack = snapshot_of(u64::MAX - 7, &[7]);

        let words = (stack.read_u64(u64::MAX - 7), stack.read_u64(u64::MAX - 3));

        assert_eq!(words, (Ok(7), Err(OutsideSnapshot { addr: u64::MAX - 3 })));
    }

    #[test]
    fn pt_regs_fields_sit_at_the_kernel_offsets() {
        let words: Vec<u64> = (0..21).map(|i| 0x100 + i * 8).collect();
        let mut stack = snapshot_of(0x2000, &words);

        let regs = PtRegs::read(&mut stack, 0x2000).unwrap();

        assert_eq!(
            [
                regs.r15,
                regs.bp,
                regs.bx,
                regs.r10,
                regs.r13,
                regs.dx,
                regs.di,
                regs.orig_ax
            ],
            [
                0x100,
                0x100 + 32,
                0x100 + 40,
                0x100 + 56,
                0x100 + 16,
                0x100 + 96,
                0x100 + 112,
                0x100 + 120
            ]
        );
        assert_eq!(
            [regs.ip, regs.cs, regs.flags, regs.sp, regs.ss],
            [
                0x100 + 128,
                0x100 + 136,
                0x100 + 144,
                0x100 + 152,
                0x100 + 160
            ]
        );
    }

    #[test]
    fn pt_regs_round_trips_through_its_words() {
        let regs = PtRegs {
            r13: 13,
            ip: 0xffff_ffff_8100_0000,
            cs: 0x10,
            sp: 0xffff_c900_0000_3f00,
            ..PtRegs::default()
        };
        let mut stack = snapshot_of(0x3000, &regs.to_words());

        let read = PtRegs::read(&mut stack, 0x3000).unwrap();

        assert_eq!(read, regs);
    }

    #[test]
    fn iret_frame_reads_the_five_hardware_words() {
        let mut stack = snapshot_of(
            0x4000,
            &[0xffff_ffff_8100_1234, 0x33, 0x246, 0x7ffc_0000, 0x2b],
        );

        let frame = IretFrame::read(&mut stack, 0x4000).unwrap();

        assert_eq!(
            (frame.ip, frame.sp, frame.user_mode()),
            (0xffff_ffff_8100_1234, 0x7ffc_0000, true)
        );
    }

    #[test]
    fn inactive_task_frame_has_bp_and_return_address_last() {
        let mut stack = snapshot_of(0x5000, &[15, 14, 13, 12, 11, 0xbbbb, 0xffff_ffff_81c0_0000]);

        let frame = InactiveTaskFrame::read(&mut stack, 0x5000).unwrap();

        assert_eq!(
            (frame.bx, frame.bp, frame.ret_addr),
            (11, 0xbbbb, 0xffff_ffff_81c0_0000)
        );
    }

    #[test]
    fn register_frame_read_reports_the_failing_address() {
        let mut stack = snapshot_of(0x6000, &[0; 4]);

        let err = PtRegs::read(&mut stack, 0x6000).unwrap_err();

        assert_eq!(err, (0x6020, OutsideSnapshot { addr: 0x6020 }));
    }
}
