//! The legacy LZ4 frame that the kernel's `cmd_lz4` (`lz4 -l`) makes: the magic, then blocks
//! each prefixed by their little-endian compressed size, each decompressing to at most 8 MiB.
//!
//! Parsed here by hand around `lz4_flex`'s block decoder: the frame is four bytes of magic and
//! a size per block, and `lz4_flex` reads only the modern frame format.

use super::{decompress, Compression, ImageError};

/// Magic of the LZ4 legacy frame (0x184c2102 little-endian).
pub const LZ4_LEGACY_MAGIC: [u8; 4] = [0x02, 0x21, 0x4c, 0x18];
/// Most bytes one legacy-LZ4 block decompresses to.
const LZ4_LEGACY_BLOCK: usize = 8 << 20;

/// Decompresses a kernel payload that is a legacy-LZ4 stream followed by the size trailer the
/// kernel's build appends; the same as [`decompress`] for such a payload.
///
/// # Errors
/// [`ImageError::UnsupportedCompression`] without the magic, and the errors of [`decompress`]
/// for a legacy-LZ4 payload: [`ImageError::Lz4BlockSize`] or [`ImageError::Lz4`] for a
/// corrupt block, [`ImageError::TooLarge`], [`ImageError::SizeTrailerMismatch`].
pub fn decompress_lz4_legacy(payload: &[u8]) -> Result<Vec<u8>, ImageError> {
    match Compression::detect(payload) {
        Compression::Lz4Legacy => decompress(payload),
        other => Err(ImageError::UnsupportedCompression(other)),
    }
}

/// Decompresses a legacy-LZ4 `stream` (without the size trailer) to at most `limit` bytes. A
/// repeated magic starts a new frame.
///
/// # Errors
/// [`ImageError::UnsupportedCompression`] without the magic, [`ImageError::Truncated`] for a
/// stream that ends inside a size field, [`ImageError::Lz4BlockSize`] or [`ImageError::Lz4`]
/// for a corrupt block, [`ImageError::TooLarge`].
pub(super) fn decode(stream: &[u8], limit: usize) -> Result<Vec<u8>, ImageError> {
    let mut rest =
        stream
            .strip_prefix(&LZ4_LEGACY_MAGIC)
            .ok_or(ImageError::UnsupportedCompression(Compression::detect(
                stream,
            )))?;
    let mut out = Vec::new();
    while !rest.is_empty() {
        let offset = stream.len() - rest.len();
        let Some((size_field, after)) = rest.split_first_chunk::<4>() else {
            return Err(ImageError::Truncated {
                what: "an LZ4 block's size field",
                end: u64::try_from(offset + 4).unwrap_or(u64::MAX),
                len: stream.len(),
            });
        };
        rest = after;
        if *size_field == LZ4_LEGACY_MAGIC {
            continue;
        }
        let size = u32::from_le_bytes(*size_field);
        let block = usize::try_from(size)
            .ok()
            .filter(|len| *len <= lz4_flex::block::get_maximum_output_size(LZ4_LEGACY_BLOCK))
            .and_then(|len| rest.get(..len))
            .ok_or(ImageError::Lz4BlockSize { offset, size })?;
        rest = &rest[block.len()..];
        // Decode into no more room than the limit leaves: a block that needs more is either
        // past the limit or (needing more than a whole block) corrupt.
        let start = out.len();
        let room = limit.saturating_sub(start).min(LZ4_LEGACY_BLOCK);
        out.resize(start + room, 0);
        match lz4_flex::block::decompress_into(block, &mut out[start..]) {
            Ok(written) => out.truncate(start + written),
            Err(lz4_flex::block::DecompressError::OutputTooSmall { .. })
                if room < LZ4_LEGACY_BLOCK =>
            {
                return Err(ImageError::TooLarge { limit });
            }
            Err(source) => return Err(ImageError::Lz4 { offset, source }),
        }
    }
    Ok(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `data` as a legacy-LZ4 payload in `block`-sized blocks, with the size trailer.
    pub(crate) fn legacy_stream(data: &[u8], block: usize) -> Vec<u8> {
        let mut out = LZ4_LEGACY_MAGIC.to_vec();
        for chunk in data.chunks(block) {
            let compressed = lz4_flex::block::compress(chunk);
            out.extend_from_slice(&u32::try_from(compressed.len()).unwrap().to_le_bytes());
            out.extend_from_slice(&compressed);
        }
        out.extend_from_slice(&u32::try_from(data.len()).unwrap().to_le_bytes());
        out
    }

    /// 1.2 MB that compress well.
    pub(crate) fn sample_data() -> Vec<u8> {
        (0..300_000u32)
            .flat_map(|i| (i % 251).to_le_bytes())
            .collect()
    }

    #[test]
    fn lz4_legacy_round_trips_multiple_blocks() {
        let data = sample_data();
        let stream = legacy_stream(&data, 100_000);

        let out = decompress_lz4_legacy(&stream).unwrap();

        assert_eq!(out, data);
    }

    #[test]
    fn lz4_legacy_refuses_block_past_end() {
        let mut stream = legacy_stream(&sample_data(), 1 << 20);
        stream.truncate(100);

        let err = decompress_lz4_legacy(&stream).unwrap_err();

        assert!(matches!(err, ImageError::Lz4BlockSize { offset: 4, .. }));
    }

    #[test]
    fn lz4_legacy_reports_corrupt_block() {
        let mut stream = LZ4_LEGACY_MAGIC.to_vec();
        stream.extend_from_slice(&4u32.to_le_bytes());
        stream.extend_from_slice(&[0xff, 0xff, 0xff, 0xff]);
        stream.extend_from_slice(&[0, 0, 0, 0, 0]);

        let err = decompress_lz4_legacy(&stream).unwrap_err();

        assert!(matches!(err, ImageError::Lz4 { offset: 4, .. }));
    }

    #[test]
    fn lz4_legacy_refuses_stream_ending_inside_size_field() {
        let mut stream = legacy_stream(&sample_data(), 1 << 20);
        let trailer = stream.split_off(stream.len() - 4);
        stream.extend_from_slice(&[0, 0]);
        stream.extend_from_slice(&trailer);

        let err = decompress_lz4_legacy(&stream).unwrap_err();

        assert!(matches!(
            err,
            ImageError::Truncated {
                what: "an LZ4 block's size field",
                ..
            }
        ));
    }

    #[test]
    fn lz4_legacy_refuses_non_lz4_payload() {
        let err = decompress_lz4_legacy(&[0x1f, 0x8b, 8, 0, 0, 0, 0, 0]).unwrap_err();

        assert!(matches!(
            err,
            ImageError::UnsupportedCompression(Compression::Gzip)
        ));
    }

    #[test]
    fn lz4_legacy_block_past_limit_is_too_large() {
        let data = sample_data();
        let stream = legacy_stream(&data, 100_000);
        let (body, _) = stream.split_at(stream.len() - 4);

        let err = decode(body, data.len() - 1).unwrap_err();

        assert!(matches!(err, ImageError::TooLarge { .. }));
    }
}
