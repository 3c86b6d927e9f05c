//! The kernel image: a bzImage's setup header, its compressed payload, and the ELF vmlinux
//! inside it.
//!
//! Boot protocol (Documentation/x86/boot.rst): `setup_sects` at 0x1f1, `"HdrS"` at 0x202,
//! `payload_offset`/`payload_length` at 0x248/0x24c counted from the start of the
//! protected-mode code, which follows the `setup_sects + 1` real-mode sectors. The payload is
//! decompressed by [`decompress`], in every format the kernel's build makes.

use object::{Object, ObjectSection, ObjectSegment};

mod decompress;
mod lz4_legacy;
mod lzop;

pub use decompress::{decompress, Compression};
pub use lz4_legacy::{decompress_lz4_legacy, LZ4_LEGACY_MAGIC};

/// Why an image could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// An unpacked vmlinux file could not be mapped.
    #[error("cannot map the vmlinux file")]
    Map(#[source] std::io::Error),
    /// The file is too short for what a header says it holds.
    #[error("the image is truncated: {what} needs bytes up to {end:#x}, the file has {len:#x}")]
    Truncated {
        /// What was being read.
        what: &'static str,
        /// One past the last byte needed.
        end: u64,
        /// The file length (for a payload's own structures, the length of the payload).
        len: usize,
    },
    /// No `"HdrS"` signature: not a bzImage.
    #[error("no \"HdrS\" setup-header signature at 0x202: not a bzImage")]
    NotBzImage,
    /// The boot protocol is older than 2.08, which has no payload fields.
    #[error("boot protocol {major}.{minor:02} has no payload fields (needs 2.08 or newer)")]
    OldProtocol {
        /// Major version.
        major: u8,
        /// Minor version.
        minor: u8,
    },
    /// The payload's magic bytes name no compression this reader decompresses.
    #[error("the payload's compression ({0:?}) is not one this reader decompresses")]
    UnsupportedCompression(Compression),
    /// The 4-byte size the kernel's build appends to the payload disagrees with what its
    /// stream decompresses to: the stream ended early or is not the one the build made.
    #[error(
        "the payload's size trailer says {trailer:#x} bytes, its stream decompresses to \
         {decompressed:#x}"
    )]
    SizeTrailerMismatch {
        /// The size the trailer holds.
        trailer: u32,
        /// The size the stream decompressed to.
        decompressed: usize,
    },
    /// The payload decompresses to more than any vmlinux needs.
    #[error("the payload decompresses to more than {limit:#x} bytes")]
    TooLarge {
        /// The limit.
        limit: usize,
    },
    /// The gzip stream is corrupt (its deflate data, CRC-32 or length).
    #[error("the gzip stream is corrupt")]
    Gzip(#[source] std::io::Error),
    /// The bzip2 stream is corrupt.
    #[error("the bzip2 stream is corrupt")]
    Bzip2(#[source] std::io::Error),
    /// The 13-byte header of the legacy `.lzma` format is invalid.
    #[error("the .lzma header is invalid")]
    LzmaHeader(#[source] std::io::Error),
    /// The `.lzma` stream is corrupt.
    #[error("the .lzma stream is corrupt")]
    Lzma(#[source] std::io::Error),
    /// The xz stream is corrupt (its headers, LZMA2 data, filters or check).
    #[error("the xz stream is corrupt")]
    Xz(#[source] std::io::Error),
    /// The zstd frame header is invalid.
    #[error("the zstd frame header is invalid")]
    ZstdFrameHeader(#[source] ruzstd::decoding::errors::FrameDecoderError),
    /// A block of the zstd frame is corrupt.
    #[error("the zstd frame is corrupt")]
    Zstd(#[source] std::io::Error),
    /// The zstd frame decompressed to bytes whose checksum is not the one it stores.
    #[error("the zstd frame's checksum is {stored:#010x}, its content hashes to {computed:#010x}")]
    ZstdChecksum {
        /// The checksum at the end of the frame.
        stored: u32,
        /// The low 32 bits of the XXH64 of the decompressed bytes.
        computed: u32,
    },
    /// A legacy-LZ4 block is corrupt.
    #[error("LZ4 block at payload offset {offset:#x} is corrupt")]
    Lz4 {
        /// Offset of the block's size field inside the payload.
        offset: usize,
        /// The cause.
        #[source]
        source: lz4_flex::block::DecompressError,
    },
    /// A legacy-LZ4 block claims more compressed bytes than the format allows.
    #[error("LZ4 block at payload offset {offset:#x} claims {size:#x} compressed bytes")]
    Lz4BlockSize {
        /// Offset of the block's size field inside the payload.
        offset: usize,
        /// The claimed size.
        size: u32,
    },
    /// The lzop stream applies a filter to its data, which the kernel's build never asks for.
    #[error("the lzop stream applies filter {0:#x}, which this reader does not undo")]
    LzopFilter(u32),
    /// The lzop stream's method is not one of LZO1X's.
    #[error("the lzop stream's method is {0}, not LZO1X (1, 2 or 3)")]
    LzopMethod(u8),
    /// A checksum in the lzop stream does not match the bytes it covers.
    #[error("the lzop {what} checksum at payload offset {offset:#x} does not match")]
    LzopChecksum {
        /// What the checksum covers: the header, its extra field, or a block's data.
        what: &'static str,
        /// Offset of the header or block inside the payload.
        offset: usize,
    },
    /// An lzop block's sizes are impossible: more than lzop's 64 MiB, no compressed bytes, or
    /// more compressed than uncompressed bytes.
    #[error(
        "lzop block at payload offset {offset:#x} claims {compressed:#x} compressed bytes for \
         {uncompressed:#x} bytes"
    )]
    LzopBlockSize {
        /// Offset of the block's header inside the payload.
        offset: usize,
        /// The uncompressed size it claims.
        uncompressed: u32,
        /// The compressed size it claims.
        compressed: u32,
    },
    /// An LZO1X block inside the lzop stream is corrupt.
    #[error("LZO block at payload offset {offset:#x} is corrupt")]
    Lzo {
        /// Offset of the block's header inside the payload.
        offset: usize,
        /// The cause.
        #[source]
        source: lzokay::Error,
    },
    /// An LZO1X block decompressed to fewer bytes than its header claims.
    #[error(
        "LZO block at payload offset {offset:#x} decompressed to {actual:#x} bytes, not \
         {expected:#x}"
    )]
    LzoBlockLength {
        /// Offset of the block's header inside the payload.
        offset: usize,
        /// The uncompressed size its header claims.
        expected: u32,
        /// The bytes it decompressed to.
        actual: usize,
    },
    /// The decompressed payload is not an ELF file the `object` crate accepts.
    #[error("the vmlinux is not a readable ELF file")]
    Elf(#[source] object::Error),
    /// The vmlinux is not a 64-bit x86 ELF.
    #[error("the vmlinux is not a 64-bit x86 ELF file")]
    NotX86_64,
    /// No file bytes at a link-time virtual address.
    #[error("no file bytes at virtual address {addr:#x} ({len} bytes) in the vmlinux")]
    NotInFile {
        /// The address.
        addr: u64,
        /// The length.
        len: usize,
    },
    /// A named section is missing.
    #[error("the vmlinux has no {0} section")]
    NoSection(&'static str),
}

/// The fields of a bzImage setup header this crate uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SetupHeader {
    /// Real-mode setup sectors (0 means 4).
    pub setup_sects: u8,
    /// Boot protocol version, major.minor as 0xMMmm.
    pub version: u16,
    /// File offset of the protected-mode code.
    pub protected_mode_offset: u64,
    /// Payload offset, relative to the protected-mode code.
    pub payload_offset: u32,
    /// Payload length in bytes.
    pub payload_length: u32,
}

impl SetupHeader {
    /// Parses the setup header of a bzImage.
    ///
    /// # Errors
    /// [`ImageError::Truncated`], [`ImageError::NotBzImage`], [`ImageError::OldProtocol`].
    pub fn parse(image: &[u8]) -> Result<Self, ImageError> {
        let header = image.get(..0x250).ok_or(ImageError::Truncated {
            what: "the setup header",
            end: 0x250,
            len: image.len(),
        })?;
        if &header[0x202..0x206] != b"HdrS" {
            return Err(ImageError::NotBzImage);
        }
        let version = u16::from_le_bytes([header[0x206], header[0x207]]);
        if version < 0x0208 {
            let [minor, major] = version.to_le_bytes();
            return Err(ImageError::OldProtocol { major, minor });
        }
        let setup_sects = header[0x1f1];
        let sects = if setup_sects == 0 {
            4
        } else {
            u64::from(setup_sects)
        };
        let u32_at = |at: usize| {
            u32::from_le_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]])
        };
        Ok(Self {
            setup_sects,
            version,
            protected_mode_offset: (sects + 1) * 512,
            payload_offset: u32_at(0x248),
            payload_length: u32_at(0x24c),
        })
    }

    /// The compressed payload's bytes inside `image`.
    ///
    /// # Errors
    /// [`ImageError::Truncated`] when the payload runs past the end of the file.
    pub fn payload<'a>(&self, image: &'a [u8]) -> Result<&'a [u8], ImageError> {
        let start = self.protected_mode_offset + u64::from(self.payload_offset);
        let end = start + u64::from(self.payload_length);
        let truncated = ImageError::Truncated {
            what: "the payload",
            end,
            len: image.len(),
        };
        let (start, end) = match (usize::try_from(start), usize::try_from(end)) {
            (Ok(start), Ok(end)) => (start, end),
            _ => return Err(truncated),
        };
        image.get(start..end).ok_or(truncated)
    }
}

/// Extracts the ELF vmlinux from a bzImage.
///
/// # Errors
/// Header errors from [`SetupHeader::parse`], [`SetupHeader::payload`], and the errors of
/// [`decompress`].
pub fn extract_vmlinux(bzimage: &[u8]) -> Result<Vec<u8>, ImageError> {
    let header = SetupHeader::parse(bzimage)?;
    decompress(header.payload(bzimage)?)
}

/// A section of the vmlinux.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Section {
    /// Its name (`.text`, `.rodata`, ...).
    pub name: String,
    /// Link-time virtual address.
    pub addr: u64,
    /// Size in memory.
    pub size: u64,
    /// Range of its bytes in the file, absent for `NOBITS` sections such as `.bss`.
    pub file_range: Option<(u64, u64)>,
}

/// A loadable segment: link-time virtual address ↔ file bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Segment {
    addr: u64,
    file_offset: u64,
    file_size: u64,
}

/// The bytes of a vmlinux: decompressed into memory, or a file mapped read-only.
#[derive(Debug, Clone)]
enum ElfBytes {
    Owned(std::sync::Arc<Vec<u8>>),
    Mapped(std::sync::Arc<memmap2::Mmap>),
}

impl std::ops::Deref for ElfBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Self::Owned(v) => v,
            Self::Mapped(m) => m,
        }
    }
}

/// The ELF vmlinux, in memory or mapped from a file, with its sections and segments parsed
/// once.
#[derive(Debug, Clone)]
pub struct Vmlinux {
    data: ElfBytes,
    sections: Vec<Section>,
    segments: Vec<Segment>,
    build_id: Option<Vec<u8>>,
}

impl Vmlinux {
    /// Parses an ELF vmlinux.
    ///
    /// # Errors
    /// [`ImageError::Elf`] for a malformed file, [`ImageError::NotX86_64`] for another
    /// architecture.
    pub fn parse(data: Vec<u8>) -> Result<Self, ImageError> {
        Self::parse_bytes(ElfBytes::Owned(std::sync::Arc::new(data)))
    }

    /// Maps the ELF vmlinux `file` read-only and parses it: only the pages read (symbols,
    /// BTF, ORC) come into memory. The file must not change while mapped: exotap maps only
    /// the unpacked copies it keeps in its cache, written once to a temporary name and
    /// renamed into place, never written again.
    ///
    /// # Errors
    /// [`ImageError::Map`] when the file cannot be mapped, then as [`Vmlinux::parse`].
    pub fn map(file: &std::fs::File) -> Result<Self, ImageError> {
        // SAFETY: a read-only private mapping; the file is one exotap never modifies in place
        // (see above), so the bytes do not change under the references handed out.
        let map = unsafe { memmap2::Mmap::map(file) }.map_err(ImageError::Map)?;
        Self::parse_bytes(ElfBytes::Mapped(std::sync::Arc::new(map)))
    }

    fn parse_bytes(data: ElfBytes) -> Result<Self, ImageError> {
        let file = object::File::parse(&*data).map_err(ImageError::Elf)?;
        if file.architecture() != object::Architecture::X86_64 || !file.is_64() {
            return Err(ImageError::NotX86_64);
        }
        let sections = file
            .sections()
            .map(|section| Section {
                name: section.name().unwrap_or("").to_owned(),
                addr: section.address(),
                size: section.size(),
                file_range: section.file_range(),
            })
            .collect();
        let segments = file
            .segments()
            .map(|segment| {
                let (file_offset, file_size) = segment.file_range();
                Segment {
                    addr: segment.address(),
                    file_offset,
                    file_size,
                }
            })
            .collect();
        let build_id = file
            .build_id()
            .map_err(ImageError::Elf)?
            .map(<[u8]>::to_vec);
        Ok(Self {
            data,
            sections,
            segments,
            build_id,
        })
    }

    /// Extracts and parses the vmlinux inside a bzImage.
    ///
    /// # Errors
    /// As [`extract_vmlinux`] and [`Vmlinux::parse`].
    pub fn from_bzimage(bzimage: &[u8]) -> Result<Self, ImageError> {
        Self::parse(extract_vmlinux(bzimage)?)
    }

    /// The whole ELF file.
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// All sections, in file order.
    pub fn sections(&self) -> &[Section] {
        &self.sections
    }

    /// The section called `name`.
    pub fn section(&self, name: &str) -> Option<&Section> {
        self.sections.iter().find(|section| section.name == name)
    }

    /// The bytes of a section that has file bytes.
    ///
    /// # Errors
    /// [`ImageError::NoSection`] when absent or without file bytes, [`ImageError::Truncated`].
    pub fn section_data(&self, name: &'static str) -> Result<&[u8], ImageError> {
        let section = self.section(name).ok_or(ImageError::NoSection(name))?;
        let (offset, size) = section.file_range.ok_or(ImageError::NoSection(name))?;
        self.file_bytes(offset, size, "a section")
    }

    /// Link-time `[start, end)` of `.text`.
    ///
    /// # Errors
    /// [`ImageError::NoSection`] without `.text`.
    pub fn text_range(&self) -> Result<(u64, u64), ImageError> {
        let text = self
            .section(".text")
            .ok_or(ImageError::NoSection(".text"))?;
        Ok((text.addr, text.addr.saturating_add(text.size)))
    }

    /// The GNU build id, when the image has one.
    pub fn build_id(&self) -> Option<&[u8]> {
        self.build_id.as_deref()
    }

    /// The file bytes at a link-time virtual address.
    ///
    /// # Errors
    /// [`ImageError::NotInFile`] when the range is not inside one segment's file bytes (e.g.
    /// `.bss`, or outside the image).
    pub fn read_at(&self, addr: u64, len: usize) -> Result<&[u8], ImageError> {
        let not_in_file = ImageError::NotInFile { addr, len };
        let len64 = u64::try_from(len).map_err(|_| ImageError::NotInFile { addr, len })?;
        let end = addr
            .checked_add(len64)
            .ok_or(ImageError::NotInFile { addr, len })?;
        let segment = self
            .segments
            .iter()
            .find(|seg| {
                addr >= seg.addr
                    && seg
                        .addr
                        .checked_add(seg.file_size)
                        .is_some_and(|e| end <= e)
            })
            .ok_or(not_in_file)?;
        let offset = segment.file_offset + (addr - segment.addr);
        self.file_bytes(offset, len64, "a segment")
    }

    /// The file offset of a link-time virtual address, when it has file bytes.
    pub fn file_offset_of(&self, addr: u64) -> Option<u64> {
        self.segments
            .iter()
            .find(|seg| addr >= seg.addr && addr - seg.addr < seg.file_size)
            .map(|seg| seg.file_offset + (addr - seg.addr))
    }

    fn file_bytes(&self, offset: u64, size: u64, what: &'static str) -> Result<&[u8], ImageError> {
        let end = offset.saturating_add(size);
        let truncated = ImageError::Truncated {
            what,
            end,
            len: self.data.len(),
        };
        let (start, end) = match (usize::try_from(offset), usize::try_from(end)) {
            (Ok(start), Ok(end)) => (start, end),
            _ => return Err(truncated),
        };
        self.data.get(start..end).ok_or(truncated)
    }
}

/// Where `exotap image fetch` caches a kernel release:
/// `$XDG_CACHE_HOME/exotap/kernels/RELEASE` or `~/.cache/exotap/kernels/RELEASE`.
pub fn cached_kernel_dir(release: &str) -> Option<std::path::PathBuf> {
    let cache = match std::env::var_os("XDG_CACHE_HOME") {
        Some(dir) if !dir.is_empty() => std::path::PathBuf::from(dir),
        _ => std::path::PathBuf::from(std::env::var_os("HOME")?).join(".cache"),
    };
    Some(cache.join("exotap").join("kernels").join(release))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::lz4_legacy::tests::{legacy_stream, sample_data};
    use super::*;

    /// The Debian kernel the real-image tests use.
    pub(crate) const RELEASE: &str = "6.1.0-50-cloud-amd64";

    /// The cached Debian vmlinux, or `None` after printing why it is skipped (it is absent);
    /// panics when it is there but cannot be read or unpacked.
    pub(crate) fn real_vmlinux() -> Option<Vmlinux> {
        let Some(path) = cached_kernel_dir(RELEASE).map(|dir| dir.join("vmlinuz")) else {
            println!("SKIP: no HOME or XDG_CACHE_HOME to find the kernel cache");
            return None;
        };
        let image = match std::fs::read(&path) {
            Ok(image) => image,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                println!(
                    "SKIP: {} is absent; run `exotap image fetch` first",
                    path.display()
                );
                return None;
            }
            // Present but unreadable: a failure, not a missing cache.
            Err(e) => panic!("cannot read the cached {}: {e}", path.display()),
        };
        Some(Vmlinux::from_bzimage(&image).unwrap())
    }

    /// A minimal bzImage around `payload`.
    fn synthetic_bzimage(payload: &[u8]) -> Vec<u8> {
        let setup_sects = 1u8;
        let pm_offset = (usize::from(setup_sects) + 1) * 512;
        let mut image = vec![0u8; pm_offset + 0x100];
        image[0x1f1] = setup_sects;
        image[0x202..0x206].copy_from_slice(b"HdrS");
        image[0x206..0x208].copy_from_slice(&0x020fu16.to_le_bytes());
        image[0x248..0x24c].copy_from_slice(&0x100u32.to_le_bytes());
        image[0x24c..0x250].copy_from_slice(&u32::try_from(payload.len()).unwrap().to_le_bytes());
        image.extend_from_slice(payload);
        image.extend_from_slice(&[0u8; 16]);
        image
    }

    #[test]
    fn setup_header_locates_payload_after_setup_sectors() {
        let payload = legacy_stream(&sample_data(), 1 << 20);
        let image = synthetic_bzimage(&payload);

        let header = SetupHeader::parse(&image).unwrap();

        assert_eq!(header.protected_mode_offset, 1024);
        assert_eq!(header.payload(&image).unwrap(), &payload[..]);
    }

    #[test]
    fn extract_vmlinux_decompresses_synthetic_bzimage() {
        let data = sample_data();
        let image = synthetic_bzimage(&legacy_stream(&data, 1 << 20));

        let out = extract_vmlinux(&image).unwrap();

        assert_eq!(out, data);
    }

    #[test]
    fn setup_header_refuses_missing_signature() {
        let image = vec![0u8; 4096];

        let err = SetupHeader::parse(&image).unwrap_err();

        assert!(matches!(err, ImageError::NotBzImage));
    }

    #[test]
    fn setup_header_refuses_payload_past_end_of_file() {
        let mut image = synthetic_bzimage(&[1, 2, 3]);
        image[0x24c..0x250].copy_from_slice(&u32::MAX.to_le_bytes());

        let header = SetupHeader::parse(&image).unwrap();

        assert!(matches!(
            header.payload(&image),
            Err(ImageError::Truncated { .. })
        ));
    }

    #[test]
    fn vmlinux_refuses_non_elf() {
        let err = Vmlinux::parse(vec![0u8; 64]).unwrap_err();

        assert!(matches!(err, ImageError::Elf(_)));
    }

    #[test]
    fn real_image_is_lz4_elf_with_text_and_build_id() {
        let Some(vmlinux) = real_vmlinux() else {
            return;
        };

        let (start, end) = vmlinux.text_range().unwrap();

        assert_eq!(start, 0xffff_ffff_8100_0000);
        assert!(end - start > 10 << 20, ".text is {:#x} bytes", end - start);
        assert_eq!(vmlinux.build_id().map(<[u8]>::len), Some(20));
        assert_eq!(vmlinux.read_at(start, 4).unwrap().len(), 4);
        assert!(vmlinux.section(".rodata").is_some());
    }
}
