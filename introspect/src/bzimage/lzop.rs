//! The lzop file format, which the kernel's `cmd_lzo` (`lzop -9`) wraps its LZO1X blocks in.
//!
//! Parsed here by hand around `lzokay`'s block decoder: the maintained, permissively licensed
//! LZO crates decode raw LZO1X blocks only (liblzo2 and the crates that bind or port it are
//! GPL), and the container is small. Its layout is lzop's own (`read_header` in lzop.c,
//! `x_decompress` in p_lzo.c):
//!
//! - magic `89 4c 5a 4f 00 0d 0a 1a 0a`; then big-endian fields: version (u16), library version
//!   (u16), version needed to extract (u16, from version 0x0940), method (u8), level (u8, from
//!   0x0940), flags (u32), filter (u32, when flagged), mode (u32), mtime low (u32), mtime high
//!   (u32, from 0x0940), name length (u8) and name, then the Adler-32 (or CRC-32) of every
//!   header byte after the magic; an optional extra field follows, with its own checksum;
//! - blocks: uncompressed length (u32, 0 ends the stream), compressed length (u32), the
//!   checksums of the uncompressed data the flags ask for, those of the compressed data when
//!   the block is compressed, then the data: stored as is when both lengths are equal.

use super::{Compression, ImageError};

/// The lzop file magic.
const MAGIC: [u8; 9] = [0x89, b'L', b'Z', b'O', 0x00, 0x0d, 0x0a, 0x1a, 0x0a];
/// The first lzop version whose header has the version-needed, level and mtime-high fields.
const VERSION_LONG_HEADER: u16 = 0x0940;
/// lzop's largest block (`MAX_BLOCK_SIZE` in lzop's conf.h): a bigger one is corrupt.
const MAX_BLOCK: u32 = 64 << 20;
/// The methods that make LZO1X blocks: LZO1X-1, LZO1X-1(15) and LZO1X-999.
const LZO1X_METHODS: std::ops::RangeInclusive<u8> = 1..=3;

/// Adler-32 of the uncompressed data of each block.
const F_ADLER32_D: u32 = 0x0001;
/// Adler-32 of the compressed data of each compressed block.
const F_ADLER32_C: u32 = 0x0002;
/// The header has an extra field.
const F_H_EXTRA_FIELD: u32 = 0x0040;
/// CRC-32 of the uncompressed data of each block.
const F_CRC32_D: u32 = 0x0100;
/// CRC-32 of the compressed data of each compressed block.
const F_CRC32_C: u32 = 0x0200;
/// The header names a filter applied to the data.
const F_H_FILTER: u32 = 0x0800;
/// The header checksum is a CRC-32, not an Adler-32.
const F_H_CRC32: u32 = 0x1000;

/// Decompresses an lzop `stream` (without the size trailer) to at most `limit` bytes.
///
/// # Errors
/// [`ImageError::UnsupportedCompression`] without the magic, [`ImageError::Truncated`] when
/// the header or a block runs past the end, [`ImageError::LzopChecksum`],
/// [`ImageError::LzopFilter`], [`ImageError::LzopMethod`], [`ImageError::LzopBlockSize`],
/// [`ImageError::Lzo`] or [`ImageError::LzoBlockLength`] for a corrupt block,
/// [`ImageError::TooLarge`].
pub(super) fn decode(stream: &[u8], limit: usize) -> Result<Vec<u8>, ImageError> {
    let mut cursor = Cursor { stream, at: 0 };
    let flags = read_header(&mut cursor)?;
    let mut out = Vec::new();
    while let Some(block) = read_block(&mut cursor, flags)? {
        let start = out.len();
        let len = usize::try_from(block.uncompressed).unwrap_or(usize::MAX);
        if len > limit.saturating_sub(start) {
            return Err(ImageError::TooLarge { limit });
        }
        out.resize(start + len, 0);
        let dst = &mut out[start..];
        if block.data.len() == len {
            dst.copy_from_slice(block.data);
        } else {
            let actual = lzokay::decompress::decompress(block.data, dst).map_err(|source| {
                ImageError::Lzo {
                    offset: block.offset,
                    source,
                }
            })?;
            if actual != len {
                return Err(ImageError::LzoBlockLength {
                    offset: block.offset,
                    expected: block.uncompressed,
                    actual,
                });
            }
        }
        if !block.uncompressed_checks.verify(&out[start..]) {
            return Err(ImageError::LzopChecksum {
                what: "uncompressed block",
                offset: block.offset,
            });
        }
    }
    Ok(out)
}

/// Reads the header up to the first block and returns its flags.
fn read_header(cursor: &mut Cursor<'_>) -> Result<u32, ImageError> {
    const WHAT: &str = "the lzop header";
    if cursor.bytes(MAGIC.len(), WHAT)? != MAGIC {
        return Err(ImageError::UnsupportedCompression(Compression::detect(
            cursor.stream,
        )));
    }
    let version = cursor.u16(WHAT)?;
    let _library_version = cursor.u16(WHAT)?;
    if version >= VERSION_LONG_HEADER {
        let _version_needed = cursor.u16(WHAT)?;
    }
    let method = cursor.u8(WHAT)?;
    if version >= VERSION_LONG_HEADER {
        let _level = cursor.u8(WHAT)?;
    }
    let flags = cursor.u32(WHAT)?;
    let filter = if flags & F_H_FILTER != 0 {
        Some(cursor.u32(WHAT)?)
    } else {
        None
    };
    let _mode = cursor.u32(WHAT)?;
    let _mtime_low = cursor.u32(WHAT)?;
    if version >= VERSION_LONG_HEADER {
        let _mtime_high = cursor.u32(WHAT)?;
    }
    let name_len = cursor.u8(WHAT)?;
    let _name = cursor.bytes(usize::from(name_len), WHAT)?;
    let covered = &cursor.stream[MAGIC.len()..cursor.at];
    if !header_checksum_matches(flags, covered, cursor.u32(WHAT)?) {
        return Err(ImageError::LzopChecksum {
            what: "header",
            offset: 0,
        });
    }
    if let Some(filter) = filter {
        return Err(ImageError::LzopFilter(filter));
    }
    if !LZO1X_METHODS.contains(&method) {
        return Err(ImageError::LzopMethod(method));
    }
    if flags & F_H_EXTRA_FIELD != 0 {
        // The extra field's checksum covers its length field too.
        let offset = cursor.at;
        let len = cursor.u32(WHAT)?;
        cursor.bytes(usize::try_from(len).unwrap_or(usize::MAX), WHAT)?;
        let covered = &cursor.stream[offset..cursor.at];
        if !header_checksum_matches(flags, covered, cursor.u32(WHAT)?) {
            return Err(ImageError::LzopChecksum {
                what: "header extra field",
                offset,
            });
        }
    }
    Ok(flags)
}

fn header_checksum_matches(flags: u32, covered: &[u8], stored: u32) -> bool {
    let computed = if flags & F_H_CRC32 != 0 {
        crc32(covered)
    } else {
        adler2::adler32_slice(covered)
    };
    computed == stored
}

/// One block of the stream.
#[derive(Debug)]
struct Block<'a> {
    /// Offset of its header inside the stream.
    offset: usize,
    /// The bytes it decompresses to.
    uncompressed: u32,
    /// Its data: stored as is when as long as `uncompressed`, else LZO1X.
    data: &'a [u8],
    /// The checksums of the uncompressed data.
    uncompressed_checks: Checksums,
}

/// Reads the next block, checking its compressed data's checksums; `None` at the end marker.
fn read_block<'a>(cursor: &mut Cursor<'a>, flags: u32) -> Result<Option<Block<'a>>, ImageError> {
    const WHAT: &str = "an lzop block";
    let offset = cursor.at;
    let uncompressed = cursor.u32(WHAT)?;
    if uncompressed == 0 {
        return Ok(None);
    }
    let compressed = cursor.u32(WHAT)?;
    if uncompressed > MAX_BLOCK || compressed == 0 || compressed > uncompressed {
        return Err(ImageError::LzopBlockSize {
            offset,
            uncompressed,
            compressed,
        });
    }
    let uncompressed_checks = Checksums::read(cursor, flags, F_ADLER32_D, F_CRC32_D)?;
    let compressed_checks = if compressed < uncompressed {
        Checksums::read(cursor, flags, F_ADLER32_C, F_CRC32_C)?
    } else {
        Checksums::default()
    };
    let data = cursor.bytes(usize::try_from(compressed).unwrap_or(usize::MAX), WHAT)?;
    if !compressed_checks.verify(data) {
        return Err(ImageError::LzopChecksum {
            what: "compressed block",
            offset,
        });
    }
    Ok(Some(Block {
        offset,
        uncompressed,
        data,
        uncompressed_checks,
    }))
}

/// The checksums a block stores for one form of its data, as the header's flags ask.
#[derive(Debug, Default)]
struct Checksums {
    adler32: Option<u32>,
    crc32: Option<u32>,
}

impl Checksums {
    /// Reads the Adler-32 then the CRC-32, each when `flags` has its flag.
    fn read(
        cursor: &mut Cursor<'_>,
        flags: u32,
        adler32_flag: u32,
        crc32_flag: u32,
    ) -> Result<Self, ImageError> {
        const WHAT: &str = "an lzop block's checksums";
        let adler32 = if flags & adler32_flag != 0 {
            Some(cursor.u32(WHAT)?)
        } else {
            None
        };
        let crc32 = if flags & crc32_flag != 0 {
            Some(cursor.u32(WHAT)?)
        } else {
            None
        };
        Ok(Self { adler32, crc32 })
    }

    fn verify(&self, data: &[u8]) -> bool {
        self.adler32
            .is_none_or(|stored| adler2::adler32_slice(data) == stored)
            && self.crc32.is_none_or(|stored| crc32(data) == stored)
    }
}

fn crc32(data: &[u8]) -> u32 {
    let mut crc = flate2::Crc::new();
    crc.update(data);
    crc.sum()
}

/// Big-endian fields read from the front of the stream.
#[derive(Debug)]
struct Cursor<'a> {
    stream: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    /// The next `len` bytes of `what`.
    fn bytes(&mut self, len: usize, what: &'static str) -> Result<&'a [u8], ImageError> {
        let end = self.at.saturating_add(len);
        let bytes = self.stream.get(self.at..end).ok_or(ImageError::Truncated {
            what,
            end: u64::try_from(end).unwrap_or(u64::MAX),
            len: self.stream.len(),
        })?;
        self.at = end;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], ImageError> {
        let mut array = [0; N];
        array.copy_from_slice(self.bytes(N, what)?);
        Ok(array)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, ImageError> {
        Ok(u8::from_be_bytes(self.array(what)?))
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, ImageError> {
        Ok(u16::from_be_bytes(self.array(what)?))
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, ImageError> {
        Ok(u32::from_be_bytes(self.array(what)?))
    }
}

#[cfg(test)]
mod tests {
    use super::super::decompress::tests::{
        compress_file_with, compress_with, pseudo_random, pseudo_random_text, Reference,
    };
    use super::*;

    /// `lzop -9` then `extra` options, writing to standard output.
    fn lzop(extra: &[&'static str]) -> Reference {
        Reference {
            tool: "lzop",
            args: [&["-9", "-c"][..], extra].concat(),
        }
    }

    /// Offset of the method in a header of version 0x0940 or later without a filter.
    const METHOD_OFFSET: usize = 15;
    /// Offset of the mtime-low field in such a header.
    const MTIME_OFFSET: usize = 25;
    /// Offset of the name length in such a header.
    const NAME_LEN_OFFSET: usize = 33;
    /// Offset of the first block after such a header without a name.
    const FIRST_BLOCK_OFFSET: usize = NAME_LEN_OFFSET + 1 + 4;

    /// Rewrites the Adler-32 checksum of a nameless header after an edit.
    fn reseal_header(stream: &mut [u8]) {
        let end = NAME_LEN_OFFSET + 1;
        let checksum = adler2::adler32_slice(&stream[MAGIC.len()..end]);
        stream[end..end + 4].copy_from_slice(&checksum.to_be_bytes());
    }

    /// Text then incompressible bytes: compressed blocks, then stored ones.
    fn mixed_data() -> Vec<u8> {
        [pseudo_random_text(300_000), pseudo_random(300_000)].concat()
    }

    #[test]
    fn lzop_with_crc32_checksums_round_trips_compressed_and_stored_blocks() {
        let data = mixed_data();
        let Some(stream) = compress_with(&lzop(&["--crc32"]), &data) else {
            return;
        };

        let out = decode(&stream, usize::MAX).unwrap();

        assert!(out == data);
    }

    #[test]
    fn lzop_fast_method_round_trips() {
        let data = mixed_data();
        let Some(stream) = compress_with(&lzop(&["-1"]), &data) else {
            return;
        };

        let out = decode(&stream, usize::MAX).unwrap();

        assert!(out == data);
    }

    #[test]
    fn lzop_header_with_file_name_round_trips() {
        let data = mixed_data();
        let Some(stream) = compress_file_with(&lzop(&[]), &data) else {
            return;
        };

        let out = decode(&stream, usize::MAX).unwrap();

        assert!(out == data);
    }

    #[test]
    fn lzop_refuses_header_with_wrong_checksum() {
        let Some(mut stream) = compress_with(&lzop(&[]), &pseudo_random(1000)) else {
            return;
        };
        stream[MTIME_OFFSET] ^= 0xff;

        let err = decode(&stream, usize::MAX).unwrap_err();

        assert!(matches!(
            err,
            ImageError::LzopChecksum { what: "header", .. }
        ));
    }

    #[test]
    fn lzop_refuses_method_other_than_lzo1x() {
        let Some(mut stream) = compress_with(&lzop(&[]), &pseudo_random(1000)) else {
            return;
        };
        stream[METHOD_OFFSET] = 0x2b;
        reseal_header(&mut stream);

        let err = decode(&stream, usize::MAX).unwrap_err();

        assert!(matches!(err, ImageError::LzopMethod(0x2b)));
    }

    #[test]
    fn lzop_refuses_stored_block_with_wrong_checksum() {
        let Some(mut stream) = compress_with(&lzop(&[]), &pseudo_random(1000)) else {
            return;
        };
        // The stream ends with the block's last data byte, then the 4-byte end marker.
        let last_data_byte = stream.len() - 5;
        stream[last_data_byte] ^= 0xff;

        let err = decode(&stream, usize::MAX).unwrap_err();

        assert!(matches!(
            err,
            ImageError::LzopChecksum {
                what: "uncompressed block",
                ..
            }
        ));
    }

    #[test]
    fn lzop_refuses_block_larger_than_lzop_allows() {
        let Some(mut stream) = compress_with(&lzop(&[]), &pseudo_random(1000)) else {
            return;
        };
        let size = FIRST_BLOCK_OFFSET..FIRST_BLOCK_OFFSET + 4;
        stream[size].copy_from_slice(&(MAX_BLOCK + 1).to_be_bytes());

        let err = decode(&stream, usize::MAX).unwrap_err();

        assert!(matches!(
            err,
            ImageError::LzopBlockSize {
                offset: FIRST_BLOCK_OFFSET,
                ..
            }
        ));
    }

    #[test]
    fn lzop_refuses_corrupt_lzo1x_block() {
        let data = pseudo_random_text(10_000);
        let Some(mut stream) = compress_with(&lzop(&[]), &data) else {
            return;
        };
        // A compressed block's first byte: 0 is a literal run whose length bytes never end.
        let first_data_byte = FIRST_BLOCK_OFFSET + 12;
        stream[first_data_byte] = 0;

        let err = decode(&stream, usize::MAX).unwrap_err();

        assert!(matches!(err, ImageError::Lzo { .. }), "{err:?}");
    }
}
