//! The compressed payload of a bzImage, in every format the kernel's Kconfig offers: gzip,
//! bzip2, lzma, xz, lzo, lz4 and zstd (`arch/x86/boot/compressed/Makefile`).
//!
//! The build (`scripts/Makefile.lib`) makes each payload as `cat vmlinux.bin | TOOL`, then
//! appends the decompressed size as a little-endian u32 (`size_append`): `gzip -n -f -9`,
//! `bzip2 -9`, `lzma -9` (the legacy `.lzma` header), `xz --check=crc32 --x86
//! --lzma2=,dict=32MiB` (`scripts/xz_wrap.sh`), `lzop -9`, `lz4 -l` (the legacy frame) and
//! `zstd -22 --ultra` (one frame). The stream is decoded, then its length is checked against
//! that trailer.
//!
//! A hostile image must not exhaust host memory: every decoder's output stops one byte past a
//! limit and the payload is then refused with [`ImageError::TooLarge`]. The decoders' own
//! windows are bounded too: LZMA's grows with the output, not with the dictionary size its
//! header claims; zstd's is at most `ruzstd`'s default 128 MiB (the window of `zstd -22
//! --ultra`).

use std::io::Read;

use super::{lz4_legacy, lzop, ImageError};

/// Most bytes a payload may decompress to: a hostile image must not exhaust host memory.
const MAX_VMLINUX: usize = 1 << 30;
/// Bytes of the decompressed size the kernel's build appends to every compressed payload.
const SIZE_TRAILER: u64 = 4;

/// How a bzImage payload is compressed, from its magic bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// gzip (`1f 8b`).
    Gzip,
    /// bzip2 (`BZh`).
    Bzip2,
    /// LZMA (`5d 00 00`).
    Lzma,
    /// XZ (`fd 37 7a 58 5a 00`).
    Xz,
    /// LZO (`89 4c 5a 4f`).
    Lzo,
    /// LZ4 legacy frame (`02 21 4c 18`).
    Lz4Legacy,
    /// Zstandard (`28 b5 2f fd`).
    Zstd,
    /// Not compressed: an ELF file (`7f 45 4c 46`).
    None,
    /// Something else.
    Unknown,
}

impl Compression {
    /// Identifies the compression from the payload's first bytes.
    pub fn detect(payload: &[u8]) -> Self {
        const MAGICS: [(&[u8], Compression); 8] = [
            (&[0x1f, 0x8b], Compression::Gzip),
            (b"BZh", Compression::Bzip2),
            (&[0x5d, 0x00, 0x00], Compression::Lzma),
            (&[0xfd, b'7', b'z', b'X', b'Z', 0x00], Compression::Xz),
            (&[0x89, b'L', b'Z', b'O'], Compression::Lzo),
            (&lz4_legacy::LZ4_LEGACY_MAGIC, Compression::Lz4Legacy),
            (&[0x28, 0xb5, 0x2f, 0xfd], Compression::Zstd),
            (b"\x7fELF", Compression::None),
        ];
        MAGICS
            .iter()
            .find(|(magic, _)| payload.starts_with(magic))
            .map_or(Self::Unknown, |(_, kind)| *kind)
    }
}

/// Decompresses a bzImage payload, whatever its compression (an uncompressed ELF payload is
/// copied), to at most 1 GiB.
///
/// # Errors
/// [`ImageError::UnsupportedCompression`] for unknown magic bytes, [`ImageError::Truncated`]
/// for a payload without room for its size trailer or a truncated lzop or LZ4 stream, the
/// format's own error for a corrupt stream ([`ImageError::Gzip`], [`ImageError::Bzip2`],
/// [`ImageError::LzmaHeader`], [`ImageError::Lzma`], [`ImageError::Xz`],
/// [`ImageError::ZstdFrameHeader`], [`ImageError::Zstd`], [`ImageError::ZstdChecksum`], the
/// `Lzop*`/`Lzo*` and `Lz4*` errors), [`ImageError::TooLarge`] past the limit,
/// [`ImageError::SizeTrailerMismatch`] when the stream's length is not the trailer's.
pub fn decompress(payload: &[u8]) -> Result<Vec<u8>, ImageError> {
    decompress_with_limit(payload, MAX_VMLINUX)
}

/// [`decompress`] with the output limit as a parameter.
fn decompress_with_limit(payload: &[u8], limit: usize) -> Result<Vec<u8>, ImageError> {
    let kind = Compression::detect(payload);
    match kind {
        // CONFIG_KERNEL_UNCOMPRESSED: the payload is the ELF file itself.
        Compression::None if payload.len() > limit => return Err(ImageError::TooLarge { limit }),
        Compression::None => return Ok(payload.to_vec()),
        Compression::Unknown => return Err(ImageError::UnsupportedCompression(kind)),
        _ => {}
    }
    let (stream, trailer) = payload
        .split_last_chunk::<4>()
        .ok_or(ImageError::Truncated {
            what: "the payload's size trailer",
            end: SIZE_TRAILER,
            len: payload.len(),
        })?;
    let out = decode_stream(kind, stream, limit)?;
    let trailer = u32::from_le_bytes(*trailer);
    if u32::try_from(out.len()).ok() != Some(trailer) {
        return Err(ImageError::SizeTrailerMismatch {
            trailer,
            decompressed: out.len(),
        });
    }
    Ok(out)
}

/// Decodes the compressed `stream` (the payload less its size trailer).
fn decode_stream(kind: Compression, stream: &[u8], limit: usize) -> Result<Vec<u8>, ImageError> {
    match kind {
        Compression::Gzip => read_bounded(
            flate2::read::GzDecoder::new(stream),
            limit,
            ImageError::Gzip,
        ),
        Compression::Bzip2 => read_bounded(
            bzip2::read::BzDecoder::new(stream),
            limit,
            ImageError::Bzip2,
        ),
        Compression::Lzma => {
            // No memory limit: the window grows with the output, which `read_bounded` bounds.
            let reader = lzma_rust2::LzmaReader::new_mem_limit(stream, u32::MAX, None)
                .map_err(ImageError::LzmaHeader)?;
            read_bounded(reader, limit, ImageError::Lzma)
        }
        Compression::Xz => read_bounded(
            lzma_rust2::XzReader::new(stream, false),
            limit,
            ImageError::Xz,
        ),
        Compression::Zstd => decode_zstd(stream, limit),
        Compression::Lzo => lzop::decode(stream, limit),
        Compression::Lz4Legacy => lz4_legacy::decode(stream, limit),
        Compression::None | Compression::Unknown => Err(ImageError::UnsupportedCompression(kind)),
    }
}

/// Decodes one zstd frame and checks its content checksum, which `ruzstd` computes but
/// leaves to the caller to compare.
fn decode_zstd(stream: &[u8], limit: usize) -> Result<Vec<u8>, ImageError> {
    let mut decoder =
        ruzstd::decoding::StreamingDecoder::new(stream).map_err(ImageError::ZstdFrameHeader)?;
    let out = read_bounded(&mut decoder, limit, ImageError::Zstd)?;
    let frame = &decoder.decoder;
    if let (Some(stored), Some(computed)) = (
        frame.get_checksum_from_data(),
        frame.get_calculated_checksum(),
    ) {
        if stored != computed {
            return Err(ImageError::ZstdChecksum { stored, computed });
        }
    }
    Ok(out)
}

/// Reads `reader` to its end, but no further than one byte past `limit`.
///
/// # Errors
/// `corrupt` of the reader's error, [`ImageError::TooLarge`] past the limit.
fn read_bounded(
    reader: impl Read,
    limit: usize,
    corrupt: impl FnOnce(std::io::Error) -> ImageError,
) -> Result<Vec<u8>, ImageError> {
    let mut out = Vec::new();
    let cap = u64::try_from(limit).unwrap_or(u64::MAX).saturating_add(1);
    reader.take(cap).read_to_end(&mut out).map_err(corrupt)?;
    if out.len() > limit {
        return Err(ImageError::TooLarge { limit });
    }
    Ok(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use std::io::Write;
    use std::process::{Command, Stdio};
    use std::sync::OnceLock;

    use super::*;
    use crate::bzimage::{cached_kernel_dir, extract_vmlinux, tests::RELEASE};

    /// A reference compressor: the tool and its options. The data goes to its standard input,
    /// as in the kernel's `cat vmlinux.bin | TOOL`, unless a test gives it a file.
    #[derive(Debug, Clone)]
    pub(crate) struct Reference {
        pub(crate) tool: &'static str,
        pub(crate) args: Vec<&'static str>,
    }

    impl Reference {
        fn new(tool: &'static str, args: &[&'static str]) -> Self {
            Self {
                tool,
                args: args.to_vec(),
            }
        }
    }

    /// The Debian commands of the kernel's formats, each writing to standard output.
    fn gzip() -> Reference {
        Reference::new("gzip", &["-9", "-c"])
    }
    fn bzip2() -> Reference {
        Reference::new("bzip2", &["-9", "-c"])
    }
    fn lzma() -> Reference {
        Reference::new("lzma", &["-9", "-c"])
    }
    fn xz() -> Reference {
        Reference::new("xz", &["--check=crc32", "-9", "-c"])
    }
    /// `scripts/xz_wrap.sh` on x86: the BCJ filter for x86 code before LZMA2.
    fn xz_kernel() -> Reference {
        Reference::new(
            "xz",
            &["--check=crc32", "--x86", "--lzma2=,dict=32MiB", "-c"],
        )
    }
    fn lzop() -> Reference {
        Reference::new("lzop", &["-9", "-c"])
    }
    fn lz4() -> Reference {
        Reference::new("lz4", &["-l", "-9", "-c"])
    }
    fn zstd() -> Reference {
        Reference::new("zstd", &["-19", "-c"])
    }

    /// `data` compressed by `reference` from its standard input, or `None` after printing why
    /// the test skips when the tool is not installed.
    pub(crate) fn compress_with(reference: &Reference, data: &[u8]) -> Option<Vec<u8>> {
        let input = input_file(data);
        let stdin = std::fs::File::open(input.path()).unwrap();
        run(
            Command::new(reference.tool)
                .args(&reference.args)
                .stdin(stdin),
            reference,
        )
    }

    /// `data` compressed by `reference` from a file named on its command line, or `None` after
    /// printing why the test skips when the tool is not installed.
    pub(crate) fn compress_file_with(reference: &Reference, data: &[u8]) -> Option<Vec<u8>> {
        let input = input_file(data);
        let mut command = Command::new(reference.tool);
        command
            .args(&reference.args)
            .arg(input.path())
            .stdin(Stdio::null());
        run(&mut command, reference)
    }

    fn input_file(data: &[u8]) -> tempfile::NamedTempFile {
        let mut input = tempfile::NamedTempFile::new().unwrap();
        input.write_all(data).unwrap();
        input.flush().unwrap();
        input
    }

    /// Runs the tool; one that is not installed skips the test, one that fails fails it.
    fn run(command: &mut Command, reference: &Reference) -> Option<Vec<u8>> {
        let output = match command.output() {
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                let test = std::thread::current().name().unwrap_or("?").to_owned();
                println!(
                    "SKIP {test}: {} is not installed (ci/install-deps.sh installs it)",
                    reference.tool
                );
                return None;
            }
            output => output.unwrap(),
        };
        assert!(
            output.status.success(),
            "{reference:?} failed with {}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        Some(output.stdout)
    }

    /// `stream` as the kernel's build leaves it: followed by the decompressed size
    /// (`size_append`).
    fn with_size_trailer(mut stream: Vec<u8>, decompressed: usize) -> Vec<u8> {
        stream.extend_from_slice(&u32::try_from(decompressed).unwrap().to_le_bytes());
        stream
    }

    /// What the round-trip tests compress: the first 6 MiB of the cached Debian vmlinux (its
    /// ELF headers and the start of its text: the whole 53 MB took the reference tools over
    /// three minutes on a 2-core host) or, without it, the first 4 MiB of this test binary
    /// (machine code and data, as in a kernel).
    fn reference_input() -> &'static [u8] {
        static INPUT: OnceLock<Vec<u8>> = OnceLock::new();
        INPUT.get_or_init(|| {
            let vmlinuz = cached_kernel_dir(RELEASE).map(|dir| dir.join("vmlinuz"));
            if let Some(image) = vmlinuz.as_ref().and_then(|path| std::fs::read(path).ok()) {
                let mut vmlinux = extract_vmlinux(&image).unwrap();
                vmlinux.truncate(6 << 20);
                return vmlinux;
            }
            let exe = std::env::current_exe().unwrap();
            println!(
                "bzimage round trips: no cached {RELEASE} vmlinuz; compressing the first 4 MiB \
                 of {} instead",
                exe.display()
            );
            let mut bytes = std::fs::read(exe).unwrap();
            bytes.truncate(4 << 20);
            bytes
        })
    }

    /// `len` bytes of xorshift output: incompressible, so lzop and LZ4 store them.
    pub(crate) fn pseudo_random(len: usize) -> Vec<u8> {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state.to_le_bytes()[3]
            })
            .collect()
    }

    /// `len` bytes of words picked by xorshift: compressible, but not trivially.
    pub(crate) fn pseudo_random_text(len: usize) -> Vec<u8> {
        const WORDS: [&str; 16] = [
            "splice ", "probe ", "kernel ", "vmlinux ", "page ", "table ", "frame ", "stack ",
            "unwind ", "symbol ", "offset ", "guest ", "trap ", "point\n", "the ", "of ",
        ];
        let picks = pseudo_random(len);
        let mut text: Vec<u8> = picks
            .iter()
            .flat_map(|pick| WORDS[usize::from(pick % 16)].bytes())
            .take(len)
            .collect();
        text.truncate(len);
        text
    }

    /// The data of the error tests: several lzop blocks, quick to compress.
    fn small_input() -> Vec<u8> {
        pseudo_random_text(600_000)
    }

    /// Compresses the reference input with the tool and decompresses it here.
    fn round_trips(reference: &Reference) {
        let data = reference_input();
        let Some(stream) = compress_with(reference, data) else {
            return;
        };
        let payload = with_size_trailer(stream, data.len());

        let out = decompress(&payload).unwrap();

        assert!(
            out == data,
            "{reference:?}: the output differs from the input"
        );
    }

    /// Cuts the tool's stream in half, keeping the size trailer.
    fn truncated_is_refused(reference: &Reference, expected: fn(&ImageError) -> bool) {
        let data = small_input();
        let Some(mut stream) = compress_with(reference, &data) else {
            return;
        };
        stream.truncate(stream.len() / 2);
        let payload = with_size_trailer(stream, data.len());

        let err = decompress(&payload).unwrap_err();

        assert!(expected(&err), "{reference:?}: unexpected {err:?}");
    }

    /// Decompresses the tool's stream under a limit one byte short of its output, then
    /// exactly at it.
    fn limit_is_enforced(reference: &Reference) {
        let data = small_input();
        let Some(stream) = compress_with(reference, &data) else {
            return;
        };
        let payload = with_size_trailer(stream, data.len());

        let over = decompress_with_limit(&payload, data.len() - 1);
        let at = decompress_with_limit(&payload, data.len());

        assert!(
            matches!(over, Err(ImageError::TooLarge { limit }) if limit == data.len() - 1),
            "{reference:?}: {over:?}"
        );
        assert!(at.is_ok_and(|out| out == data), "{reference:?}");
    }

    /// Per format: a round trip of the reference input through the kernel's tool, a truncated
    /// stream refused with the format's error, and the output limit.
    macro_rules! reference_tests {
        ($($format:ident: $reference:expr, $truncated:pat,)*) => {$(
            mod $format {
                use super::*;

                #[test]
                fn payload_round_trips_through_reference_tool() {
                    round_trips(&$reference);
                }

                #[test]
                fn truncated_stream_is_refused() {
                    truncated_is_refused(&$reference, |err| matches!(err, $truncated));
                }

                #[test]
                fn output_past_limit_is_too_large() {
                    limit_is_enforced(&$reference);
                }
            }
        )*};
    }

    reference_tests! {
        gzip: gzip(), ImageError::Gzip(_),
        bzip2: bzip2(), ImageError::Bzip2(_),
        lzma: lzma(), ImageError::Lzma(_),
        xz: xz(), ImageError::Xz(_),
        xz_kernel_bcj: xz_kernel(), ImageError::Xz(_),
        lzop: lzop(), ImageError::Truncated { what: "an lzop block", .. },
        lz4: lz4(), ImageError::Lz4BlockSize { .. },
        zstd: zstd(), ImageError::Zstd(_),
    }

    /// Flips a byte in the middle of the tool's stream.
    fn corrupt_is_refused(reference: &Reference, expected: fn(&ImageError) -> bool) {
        let data = small_input();
        let Some(mut stream) = compress_with(reference, &data) else {
            return;
        };
        let middle = stream.len() / 2;
        stream[middle] ^= 0x55;
        let payload = with_size_trailer(stream, data.len());

        let err = decompress(&payload).unwrap_err();

        assert!(expected(&err), "{reference:?}: unexpected {err:?}");
    }

    #[test]
    fn gzip_corrupt_stream_is_refused() {
        corrupt_is_refused(&gzip(), |err| matches!(err, ImageError::Gzip(_)));
    }

    #[test]
    fn bzip2_corrupt_stream_is_refused() {
        corrupt_is_refused(&bzip2(), |err| matches!(err, ImageError::Bzip2(_)));
    }

    #[test]
    fn xz_corrupt_stream_is_refused() {
        corrupt_is_refused(&xz(), |err| matches!(err, ImageError::Xz(_)));
    }

    #[test]
    fn zstd_frame_with_wrong_checksum_is_refused() {
        let data = small_input();
        let Some(mut stream) = compress_with(&zstd(), &data) else {
            return;
        };
        let last = stream.len() - 1;
        stream[last] ^= 0xff;
        let payload = with_size_trailer(stream, data.len());

        let err = decompress(&payload).unwrap_err();

        assert!(matches!(err, ImageError::ZstdChecksum { .. }), "{err:?}");
    }

    #[test]
    fn size_trailer_must_match_output() {
        let data = small_input();
        let Some(stream) = compress_with(&gzip(), &data) else {
            return;
        };
        let payload = with_size_trailer(stream, data.len() + 1);

        let err = decompress(&payload).unwrap_err();

        assert!(matches!(
            err,
            ImageError::SizeTrailerMismatch { trailer, decompressed }
                if usize::try_from(trailer).unwrap() == data.len() + 1 && decompressed == data.len()
        ));
    }

    #[test]
    fn payload_shorter_than_size_trailer_is_truncated() {
        let err = decompress(&[0x1f, 0x8b, 8]).unwrap_err();

        assert!(matches!(err, ImageError::Truncated { end: 4, len: 3, .. }));
    }

    #[test]
    fn unknown_magic_is_unsupported() {
        let err = decompress(b"MZ not a kernel payload").unwrap_err();

        assert!(matches!(
            err,
            ImageError::UnsupportedCompression(Compression::Unknown)
        ));
    }

    #[test]
    fn uncompressed_elf_payload_is_copied() {
        let payload = b"\x7fELF and the rest of an uncompressed vmlinux";

        let out = decompress(payload).unwrap();

        assert_eq!(out, payload);
    }

    #[test]
    fn uncompressed_elf_payload_past_limit_is_too_large() {
        let payload = b"\x7fELF and the rest of an uncompressed vmlinux";

        let err = decompress_with_limit(payload, payload.len() - 1).unwrap_err();

        assert!(matches!(err, ImageError::TooLarge { .. }));
    }

    #[test]
    fn compression_detects_known_magics() {
        assert_eq!(
            Compression::detect(&[0x02, 0x21, 0x4c, 0x18, 9]),
            Compression::Lz4Legacy
        );
        assert_eq!(
            Compression::detect(&[0x28, 0xb5, 0x2f, 0xfd]),
            Compression::Zstd
        );
        assert_eq!(Compression::detect(&[0x1f, 0x8b, 8]), Compression::Gzip);
        assert_eq!(Compression::detect(b"BZh9"), Compression::Bzip2);
        assert_eq!(Compression::detect(&[0x5d, 0, 0, 0x80]), Compression::Lzma);
        assert_eq!(
            Compression::detect(&[0xfd, b'7', b'z', b'X', b'Z', 0]),
            Compression::Xz
        );
        assert_eq!(
            Compression::detect(&[0x89, b'L', b'Z', b'O']),
            Compression::Lzo
        );
        assert_eq!(Compression::detect(b"\x7fELF"), Compression::None);
        assert_eq!(Compression::detect(b"??"), Compression::Unknown);
    }
}
