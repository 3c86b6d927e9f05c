//! The virtual KASLR slide of a running kernel, from two independent anchors that must agree:
//! the IDT (its page-fault and divide-error gates point at known entry stubs) and
//! `linux_banner` (its bytes in the image appear at exactly one 2 MiB-aligned slide).

use crate::bzimage::{ImageError, Vmlinux};
use crate::memory::PhysicalMemory;
use crate::paging::{AddressSpace, PagingError, PTE_PRESENT, SIZE_1G, SIZE_2M};
use crate::symbols::{SymbolTable, KERNEL_MAP_BASE};

/// The virtual slide is a multiple of this (CONFIG_PHYSICAL_ALIGN on x86-64).
pub const KASLR_ALIGN: u64 = SIZE_2M;
/// The slide is below this (KERNEL_IMAGE_SIZE with KASLR).
pub const KASLR_RANGE: u64 = SIZE_1G;
/// Exception vector of #DE.
pub const VECTOR_DIVIDE_ERROR: u8 = 0;
/// Exception vector of #PF.
pub const VECTOR_PAGE_FAULT: u8 = 14;
/// Longest banner compared.
const MAX_BANNER: usize = 512;

/// Why the slide could not be established.
#[derive(Debug, thiserror::Error)]
pub enum KaslrError {
    /// The symbol table lacks an anchor symbol.
    #[error("the kernel's symbols have no {0}")]
    MissingSymbol(&'static str),
    /// The banner's bytes are not in the image file.
    #[error("linux_banner's bytes cannot be read from the image")]
    BannerInImage(#[source] ImageError),
    /// The IDT gate could not be read from the guest.
    #[error("reading IDT vector {vector} at {addr:#x} failed")]
    IdtRead {
        /// The vector.
        vector: u8,
        /// Virtual address of the gate.
        addr: u64,
        /// The cause.
        #[source]
        source: PagingError,
    },
    /// The gate is not a present interrupt/trap gate.
    #[error("IDT vector {vector} is not a present interrupt or trap gate (type {gate_type:#x})")]
    BadGate {
        /// The vector.
        vector: u8,
        /// Its type field.
        gate_type: u8,
    },
    /// A slide is not a possible KASLR slide.
    #[error(
        "the {anchor} gives slide {slide:#x}, which is not a multiple of 2 MiB below 1 GiB: the \
         symbols do not belong to the running kernel"
    )]
    ImpossibleSlide {
        /// Which anchor.
        anchor: &'static str,
        /// The slide it gave.
        slide: u64,
    },
    /// The page-fault and divide-error gates give different slides.
    #[error(
        "the IDT disagrees with itself: #PF gives slide {page_fault:#x}, #DE gives {divide_error:#x}"
    )]
    IdtInconsistent {
        /// Slide from vector 14.
        page_fault: u64,
        /// Slide from vector 0.
        divide_error: u64,
    },
    /// The banner matched at no candidate slide.
    #[error("linux_banner matched at none of the {tried} candidate slides")]
    BannerNotFound {
        /// Candidates read.
        tried: usize,
    },
    /// The banner matched at several slides.
    #[error("linux_banner matched at several slides: {slides:x?}")]
    BannerAmbiguous {
        /// Every matching slide.
        slides: Vec<u64>,
    },
    /// The two anchors disagree.
    #[error("the IDT gives slide {idt:#x} but linux_banner gives {banner:#x}")]
    AnchorsDisagree {
        /// Slide from the IDT.
        idt: u64,
        /// Slide from the banner.
        banner: u64,
    },
    /// `_text` is not mapped at the slide found.
    #[error("_text is not mapped at the slide found")]
    TextNotMapped(#[source] PagingError),
}

/// A decoded 64-bit IDT gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdtGate {
    /// The handler's virtual address.
    pub handler: u64,
    /// Code-segment selector.
    pub selector: u16,
    /// Interrupt-stack-table index (0: none).
    pub ist: u8,
    /// Gate type (0xe interrupt, 0xf trap).
    pub gate_type: u8,
    /// Descriptor privilege level.
    pub dpl: u8,
    /// Present bit.
    pub present: bool,
}

impl IdtGate {
    /// Decodes the 16 bytes of a long-mode gate descriptor.
    pub fn decode(raw: &[u8; 16]) -> Self {
        let low = u64::from(u16::from_le_bytes([raw[0], raw[1]]));
        let mid = u64::from(u16::from_le_bytes([raw[6], raw[7]]));
        let high = u64::from(u32::from_le_bytes([raw[8], raw[9], raw[10], raw[11]]));
        Self {
            handler: low | mid << 16 | high << 32,
            selector: u16::from_le_bytes([raw[2], raw[3]]),
            ist: raw[4] & 7,
            gate_type: raw[5] & 0xf,
            dpl: (raw[5] >> 5) & 3,
            present: raw[5] & 0x80 != 0,
        }
    }
}

/// What the image says the anchors look like, at link-time addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KaslrAnchors {
    /// `_text`.
    pub text: u64,
    /// `asm_exc_page_fault`, the #PF entry stub.
    pub page_fault_entry: u64,
    /// `asm_exc_divide_error`, the #DE entry stub.
    pub divide_error_entry: u64,
    /// `linux_banner`.
    pub linux_banner: u64,
    /// The banner's bytes in the image, up to its NUL.
    pub banner: Vec<u8>,
}

impl KaslrAnchors {
    /// Collects the anchors from the image's symbols and bytes.
    ///
    /// # Errors
    /// [`KaslrError::MissingSymbol`], [`KaslrError::BannerInImage`].
    pub fn from_image(symbols: &SymbolTable, vmlinux: &Vmlinux) -> Result<Self, KaslrError> {
        let addr = |name: &'static str| {
            symbols
                .get(name)
                .map(|s| s.addr)
                .ok_or(KaslrError::MissingSymbol(name))
        };
        let linux_banner = addr("linux_banner")?;
        let len = symbols
            .get("linux_banner")
            .map_or(MAX_BANNER, |s| {
                usize::try_from(s.size).unwrap_or(MAX_BANNER)
            })
            .clamp(1, MAX_BANNER);
        let bytes = vmlinux
            .read_at(linux_banner, len)
            .map_err(KaslrError::BannerInImage)?;
        let banner = bytes.split(|b| *b == 0).next().unwrap_or(bytes).to_vec();
        Ok(Self {
            text: addr("_text")?,
            page_fault_entry: addr("asm_exc_page_fault")?,
            divide_error_entry: addr("asm_exc_divide_error")?,
            linux_banner,
            banner,
        })
    }
}

/// The slide and where the kernel sits in guest-physical memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kaslr {
    /// Virtual slide: running address = link-time address + slide (kernel-image symbols).
    pub slide: u64,
    /// Guest-physical address of `_text`.
    pub text_phys: u64,
    /// Physical load offset: `text_phys` minus the link-time physical address of `_text`
    /// (`_text - __START_KERNEL_map`, i.e. CONFIG_PHYSICAL_START).
    pub phys_offset: i64,
}

/// The slide from the IDT at `idt_base` (a virtual address, e.g. from QEMU's monitor): the
/// #PF gate must point at `asm_exc_page_fault` and the #DE gate at `asm_exc_divide_error`,
/// both moved by the same slide.
///
/// # Errors
/// [`KaslrError::IdtRead`], [`KaslrError::BadGate`], [`KaslrError::IdtInconsistent`],
/// [`KaslrError::ImpossibleSlide`].
pub fn slide_from_idt<M: PhysicalMemory + ?Sized>(
    space: &mut AddressSpace<'_, M>,
    idt_base: u64,
    anchors: &KaslrAnchors,
) -> Result<u64, KaslrError> {
    let page_fault =
        read_gate(space, idt_base, VECTOR_PAGE_FAULT)?.wrapping_sub(anchors.page_fault_entry);
    let divide_error =
        read_gate(space, idt_base, VECTOR_DIVIDE_ERROR)?.wrapping_sub(anchors.divide_error_entry);
    if page_fault != divide_error {
        return Err(KaslrError::IdtInconsistent {
            page_fault,
            divide_error,
        });
    }
    check_possible("IDT", page_fault)
}

fn read_gate<M: PhysicalMemory + ?Sized>(
    space: &mut AddressSpace<'_, M>,
    idt_base: u64,
    vector: u8,
) -> Result<u64, KaslrError> {
    let addr = idt_base.wrapping_add(u64::from(vector) * 16);
    let mut raw = [0u8; 16];
    space
        .read(addr, &mut raw)
        .map_err(|source| KaslrError::IdtRead {
            vector,
            addr,
            source,
        })?;
    let gate = IdtGate::decode(&raw);
    if !gate.present || !matches!(gate.gate_type, 0xe | 0xf) {
        return Err(KaslrError::BadGate {
            vector,
            gate_type: gate.gate_type,
        });
    }
    Ok(gate.handler)
}

fn check_possible(anchor: &'static str, slide: u64) -> Result<u64, KaslrError> {
    if slide.is_multiple_of(KASLR_ALIGN) && slide < KASLR_RANGE {
        Ok(slide)
    } else {
        Err(KaslrError::ImpossibleSlide { anchor, slide })
    }
}

/// The slide at which the image's `linux_banner` bytes appear in the guest. Every 2 MiB slide
/// below 1 GiB that keeps the banner inside the kernel-image mapping is a candidate; exactly
/// one must match. The kernel-image PMD page is read once so unmapped candidates cost nothing.
///
/// # Errors
/// [`KaslrError::BannerNotFound`], [`KaslrError::BannerAmbiguous`].
pub fn slide_from_banner<M: PhysicalMemory + ?Sized>(
    space: &mut AddressSpace<'_, M>,
    anchors: &KaslrAnchors,
) -> Result<u64, KaslrError> {
    let image_pmds = image_pmd_entries(space);
    let len = anchors.banner.len() as u64;
    let mut tried = 0;
    let mut slides = Vec::new();
    let mut seen = vec![0u8; anchors.banner.len()];
    for slide in (0..KASLR_RANGE).step_by(KASLR_ALIGN as usize) {
        let Some(va) = anchors.linux_banner.checked_add(slide) else {
            break;
        };
        if va < KERNEL_MAP_BASE || va.saturating_add(len) > KERNEL_MAP_BASE + SIZE_1G {
            continue;
        }
        let index = ((va - KERNEL_MAP_BASE) / SIZE_2M) as usize;
        if image_pmds
            .as_ref()
            .is_some_and(|pmds| pmds.get(index).is_none_or(|e| e & PTE_PRESENT == 0))
        {
            continue;
        }
        tried += 1;
        if space.read(va, &mut seen).is_ok() && seen == anchors.banner {
            slides.push(slide);
        }
    }
    match slides.as_slice() {
        [] => Err(KaslrError::BannerNotFound { tried }),
        [slide] => Ok(*slide),
        _ => Err(KaslrError::BannerAmbiguous { slides }),
    }
}

/// The 512 PMD entries covering `__START_KERNEL_map`'s gigabyte, when they can be read.
fn image_pmd_entries<M: PhysicalMemory + ?Sized>(
    space: &mut AddressSpace<'_, M>,
) -> Option<Vec<u64>> {
    let slot = space.pmd_slot(KERNEL_MAP_BASE).ok()?;
    let mut page = vec![0u8; 4096];
    space.mem.read_phys(slot.pmd_page, &mut page).ok()?;
    Some(
        page.chunks_exact(8)
            .map(|e| u64::from_le_bytes([e[0], e[1], e[2], e[3], e[4], e[5], e[6], e[7]]))
            .collect(),
    )
}

/// The slide from both anchors, which must agree, and the physical load address.
///
/// # Errors
/// Any error of [`slide_from_idt`] or [`slide_from_banner`], [`KaslrError::AnchorsDisagree`],
/// [`KaslrError::TextNotMapped`].
pub fn detect<M: PhysicalMemory + ?Sized>(
    space: &mut AddressSpace<'_, M>,
    idt_base: u64,
    anchors: &KaslrAnchors,
) -> Result<Kaslr, KaslrError> {
    let idt = slide_from_idt(space, idt_base, anchors)?;
    let banner = slide_from_banner(space, anchors)?;
    if idt != banner {
        return Err(KaslrError::AnchorsDisagree { idt, banner });
    }
    let text_phys = space
        .translate(anchors.text.wrapping_add(idt))
        .map_err(KaslrError::TextNotMapped)?
        .phys;
    let link_phys = anchors.text.wrapping_sub(KERNEL_MAP_BASE);
    Ok(Kaslr {
        slide: idt,
        text_phys,
        phys_offset: text_phys.wrapping_sub(link_phys) as i64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::paging::tests::TableBuilder;
    use crate::paging::{TableLevel, PTE_GLOBAL, PTE_WRITABLE};

    const TEXT: u64 = 0xffff_ffff_8100_0000;
    const BANNER: &[u8] = b"Linux version 6.1.0-test (exotap) #1 SMP\n";
    const IDT: u64 = 0xffff_fe00_0000_0000;
    const SLIDE: u64 = 0x1e00_0000;
    /// Physical load address: physical KASLR moved the kernel to 0x7000000.
    const TEXT_PHYS: u64 = 0x700_0000;

    fn anchors() -> KaslrAnchors {
        KaslrAnchors {
            text: TEXT,
            page_fault_entry: TEXT + 0xc0_0be0,
            divide_error_entry: TEXT + 0xc0_0990,
            linux_banner: TEXT + 0x111_fa00,
            banner: BANNER.to_vec(),
        }
    }

    fn gate(handler: u64, gate_type: u8) -> [u8; 16] {
        let mut raw = [0u8; 16];
        raw[0..2].copy_from_slice(&(handler as u16).to_le_bytes());
        raw[2..4].copy_from_slice(&0x10u16.to_le_bytes());
        raw[5] = 0x80 | gate_type;
        raw[6..8].copy_from_slice(&((handler >> 16) as u16).to_le_bytes());
        raw[8..12].copy_from_slice(&((handler >> 32) as u32).to_le_bytes());
        raw
    }

    /// A guest whose IDT says `idt_slide` and whose banner sits at `banner_slide`, with the
    /// kernel image mapped by 2 MiB pages from `TEXT + banner_slide`.
    fn guest(idt_slide: u64, banner_slide: u64) -> TableBuilder {
        let a = anchors();
        let mut tb = TableBuilder::new(false);
        let mut idt = vec![0u8; 4096];
        idt[0..16].copy_from_slice(&gate(a.divide_error_entry + idt_slide, 0xe));
        idt[14 * 16..15 * 16].copy_from_slice(&gate(a.page_fault_entry + idt_slide, 0xe));
        tb.map_data(IDT, 0x20_0000, &idt);
        for mb2 in 0..24u64 {
            let flags = PTE_PRESENT | PTE_WRITABLE | PTE_GLOBAL;
            tb.map(
                TEXT + banner_slide + mb2 * SIZE_2M,
                TEXT_PHYS + mb2 * SIZE_2M,
                TableLevel::Pmd,
                flags,
            );
        }
        let banner_phys = TEXT_PHYS + (a.linux_banner - TEXT);
        tb.mem.add_region(banner_phys, BANNER.to_vec()).unwrap();
        tb
    }

    #[test]
    fn idt_gate_decodes_handler_and_type() {
        let gate = IdtGate::decode(&gate(0xffff_ffff_9fc0_0be0, 0xe));

        assert_eq!(gate.handler, 0xffff_ffff_9fc0_0be0);
        assert_eq!(
            (gate.gate_type, gate.selector, gate.present),
            (0xe, 0x10, true)
        );
    }

    #[test]
    fn detect_finds_slide_when_anchors_agree() {
        let mut tb = guest(SLIDE, SLIDE);

        let kaslr = detect(&mut tb.space(), IDT, &anchors()).unwrap();

        assert_eq!(kaslr.slide, SLIDE);
        assert_eq!(kaslr.text_phys, TEXT_PHYS);
        assert_eq!(kaslr.phys_offset, 0x600_0000);
    }

    #[test]
    fn detect_names_both_slides_when_anchors_disagree() {
        let mut tb = guest(SLIDE, SLIDE + SIZE_2M);

        let err = detect(&mut tb.space(), IDT, &anchors()).unwrap_err();

        assert!(
            matches!(err, KaslrError::AnchorsDisagree { idt: SLIDE, banner } if banner == SLIDE + SIZE_2M)
        );
        assert!(err.to_string().contains("0x1e000000") && err.to_string().contains("0x1e200000"));
    }

    #[test]
    fn idt_refuses_not_present_gate() {
        let mut tb = guest(SLIDE, SLIDE);
        let idt_phys = tb.space().translate(IDT).unwrap().phys;
        tb.mem.write_phys(idt_phys + 14 * 16 + 5, &[0x0e]).unwrap();

        let err = slide_from_idt(&mut tb.space(), IDT, &anchors()).unwrap_err();

        assert!(matches!(err, KaslrError::BadGate { vector: 14, .. }));
    }

    #[test]
    fn idt_refuses_vectors_that_disagree() {
        let mut tb = guest(SLIDE, SLIDE);
        let idt_phys = tb.space().translate(IDT).unwrap().phys;
        tb.mem
            .write_phys(idt_phys, &gate(anchors().divide_error_entry, 0xe))
            .unwrap();

        let err = slide_from_idt(&mut tb.space(), IDT, &anchors()).unwrap_err();

        assert!(matches!(
            err,
            KaslrError::IdtInconsistent {
                page_fault: SLIDE,
                divide_error: 0
            }
        ));
    }

    #[test]
    fn idt_refuses_misaligned_slide() {
        let mut tb = guest(SLIDE + 0x1000, SLIDE);

        let err = slide_from_idt(&mut tb.space(), IDT, &anchors()).unwrap_err();

        assert!(matches!(
            err,
            KaslrError::ImpossibleSlide { anchor: "IDT", .. }
        ));
    }

    #[test]
    fn banner_refuses_two_matching_slides() {
        let mut tb = guest(SLIDE, SLIDE);
        let other = anchors().linux_banner + 0x3000_0000;
        tb.map_data(other & !0xfff, 0x4000_0000, &[0u8; 8192]);
        let phys = tb.space().translate(other).unwrap().phys;
        tb.mem.write_phys(phys, BANNER).unwrap();

        let err = slide_from_banner(&mut tb.space(), &anchors()).unwrap_err();

        assert!(
            matches!(err, KaslrError::BannerAmbiguous { ref slides } if slides == &[SLIDE, 0x3000_0000])
        );
    }

    #[test]
    fn banner_reports_no_match() {
        let mut tb = guest(SLIDE, SLIDE);
        let phys = tb
            .space()
            .translate(anchors().linux_banner + SLIDE)
            .unwrap()
            .phys;
        tb.mem.write_phys(phys, b"X").unwrap();

        let err = slide_from_banner(&mut tb.space(), &anchors()).unwrap_err();

        assert!(matches!(err, KaslrError::BannerNotFound { tried } if tried > 0));
    }

    #[test]
    fn anchors_from_real_image_read_banner() {
        let Some(vmlinux) = crate::bzimage::tests::real_vmlinux() else {
            return;
        };
        let symbols = SymbolTable::from_kallsyms(&crate::kallsyms::extract(&vmlinux).unwrap());

        let anchors = KaslrAnchors::from_image(&symbols, &vmlinux).unwrap();

        assert!(
            anchors.banner.starts_with(b"Linux version 6.1.0-"),
            "{:?}",
            anchors.banner
        );
        assert_eq!(anchors.banner.last(), Some(&b'\n'));
        assert_eq!(anchors.text, 0xffff_ffff_8100_0000);
    }

    #[test]
    fn mutated_guest_gives_an_error_or_a_possible_slide() {
        use crate::mutation::{mutate_memory, XorShift};

        let banner_page = (TEXT_PHYS + (anchors().linux_banner - TEXT)) & !0xfff;
        let mut rng = XorShift(0x6a09_e667_f3bc_c908);
        for _ in 0..2000 {
            let mut tb = guest(SLIDE, SLIDE);
            let mut hot = tb.table_pages();
            hot.extend([0x20_0000, banner_page]);
            mutate_memory(&mut tb.mem, &mut rng, &hot, 8);

            let result = detect(&mut tb.space(), IDT, &anchors());

            assert!(
                result
                    .as_ref()
                    .map_or(true, |k| k.slide.is_multiple_of(KASLR_ALIGN)
                        && k.slide < KASLR_RANGE),
                "{result:?}"
            );
        }
    }
}
