//! The ORC tables of one image: `.orc_unwind_ip` and `.orc_unwind` read, validated and
//! searched.

use object::{Object, ObjectSection};

use super::entry::{OrcEntry, OrcLayout, RawOrcEntry, ENTRY_SIZE, HEADER_SIZE};
use crate::bzimage::{ImageError, Vmlinux};

/// Bytes in one `.orc_unwind_ip` entry (an `s32` relative to its own address).
const IP_SIZE: usize = 4;

/// Why ORC tables could not be read.
#[derive(Debug, thiserror::Error)]
pub enum OrcTableError {
    /// The ELF file could not be parsed.
    #[error("the ELF file holding the ORC tables is not readable")]
    Elf(#[source] object::Error),
    /// The image lacks a section the tables need.
    #[error("the image has no {0} section (a kernel built without CONFIG_UNWINDER_ORC, or section headers stripped)")]
    MissingSection(&'static str),
    /// A section's bytes could not be read from the image.
    #[error("the bytes of the {name} section are not in the image")]
    SectionData {
        /// The section.
        name: &'static str,
        /// The cause.
        #[source]
        source: ImageError,
    },
    /// The ip table is not a whole number of `s32`.
    #[error("the ip table has {len} bytes, not a multiple of 4")]
    IpTableLength {
        /// Its length in bytes.
        len: usize,
    },
    /// The entry table is not a whole number of 6-byte entries.
    #[error("the entry table has {len} bytes, not a multiple of 6")]
    EntryTableLength {
        /// Its length in bytes.
        len: usize,
    },
    /// The two tables, which run in parallel, have different lengths.
    #[error("the ip table has {ips} entries but the entry table has {entries}")]
    LengthMismatch {
        /// Entries in the ip table.
        ips: usize,
        /// Entries in the entry table.
        entries: usize,
    },
    /// Both tables are empty.
    #[error("the ORC tables are empty")]
    Empty,
    /// An ip entry points outside the 64-bit address space.
    #[error("ip table entry {index} points outside the address space")]
    IpOutOfRange {
        /// Its index.
        index: usize,
    },
    /// The ips are not in ascending order, so binary search would give wrong entries.
    #[error("the ip table is not sorted: entry {index} ({ip:#x}) is below the one before it ({prev:#x})")]
    Unsorted {
        /// Index of the first out-of-order entry.
        index: usize,
        /// Its ip.
        ip: u64,
        /// The ip of the entry before it.
        prev: u64,
    },
    /// `.orc_header` is not a 20-byte hash.
    #[error(".orc_header has {len} bytes where a build hash has 20")]
    HeaderLength {
        /// Its length.
        len: usize,
    },
    /// `.orc_header` holds a hash of a `struct orc_entry` definition this reader does not
    /// know, so it cannot tell how to decode the entries.
    #[error(".orc_header hash {hash} is not a known struct orc_entry layout (a kernel newer than this reader?)")]
    UnknownHeader {
        /// The hash, in hex.
        hash: String,
    },
}

/// The ORC tables of the kernel image or of one module.
///
/// Addresses are in the address space the tables were read in: link-time for a vmlinux file,
/// running addresses for tables read from guest memory. [`super::Unwinder`] takes the slide
/// between the two.
#[derive(Debug, Clone)]
pub struct OrcTable {
    /// The absolute ip of each entry, ascending.
    ips: Vec<u64>,
    /// The entries, parallel to `ips`.
    entries: Vec<RawOrcEntry>,
    layout: OrcLayout,
    header: Option<[u8; HEADER_SIZE]>,
}

impl OrcTable {
    /// Parses the tables from their bytes: `ip_table` (`.orc_unwind_ip`) as it sits at
    /// `ip_table_addr`, `entries` (`.orc_unwind`), and `.orc_header` when the image has one.
    /// Without a header the layout is guessed with [`OrcLayout::detect_headerless`].
    ///
    /// # Errors
    /// [`OrcTableError::HeaderLength`], [`OrcTableError::UnknownHeader`], and as
    /// [`OrcTable::parse_with_layout`].
    pub fn parse(
        ip_table: &[u8],
        ip_table_addr: u64,
        entries: &[u8],
        header: Option<&[u8]>,
    ) -> Result<Self, OrcTableError> {
        let header = header.map(parse_header).transpose()?;
        let raw = parse_entries(entries)?;
        let layout = match header {
            Some(hash) => {
                OrcLayout::from_header(&hash).ok_or_else(|| OrcTableError::UnknownHeader {
                    hash: hash.iter().map(|b| format!("{b:02x}")).collect(),
                })?
            }
            None => OrcLayout::detect_headerless(&raw),
        };
        let mut table = Self::from_parts(ip_table, ip_table_addr, raw, layout)?;
        table.header = header;
        Ok(table)
    }

    /// Parses the tables with a layout the caller knows (e.g. from the kernel version),
    /// without looking at any header.
    ///
    /// # Errors
    /// [`OrcTableError::IpTableLength`], [`OrcTableError::EntryTableLength`],
    /// [`OrcTableError::LengthMismatch`], [`OrcTableError::Empty`],
    /// [`OrcTableError::IpOutOfRange`], [`OrcTableError::Unsorted`].
    pub fn parse_with_layout(
        ip_table: &[u8],
        ip_table_addr: u64,
        entries: &[u8],
        layout: OrcLayout,
    ) -> Result<Self, OrcTableError> {
        Self::from_parts(ip_table, ip_table_addr, parse_entries(entries)?, layout)
    }

    /// Reads the tables from the sections of an ELF vmlinux (or module), at link-time
    /// addresses.
    ///
    /// # Errors
    /// [`OrcTableError::Elf`], [`OrcTableError::MissingSection`], and as
    /// [`OrcTable::parse`].
    pub fn from_elf(elf: &[u8]) -> Result<Self, OrcTableError> {
        let file = object::File::parse(elf).map_err(OrcTableError::Elf)?;
        let section = |name: &'static str| {
            file.section_by_name(name)
                .ok_or(OrcTableError::MissingSection(name))
        };
        let ip_section = section(".orc_unwind_ip")?;
        let ip_table = ip_section.data().map_err(OrcTableError::Elf)?;
        let entries = section(".orc_unwind")?.data().map_err(OrcTableError::Elf)?;
        let header = match file.section_by_name(".orc_header") {
            Some(header) => Some(header.data().map_err(OrcTableError::Elf)?),
            None => None,
        };
        Self::parse(ip_table, ip_section.address(), entries, header)
    }

    /// Reads the tables from a parsed [`Vmlinux`] (the `-dbg` file, or the ELF inside a
    /// bzImage, which keeps its section headers).
    ///
    /// # Errors
    /// [`OrcTableError::MissingSection`], [`OrcTableError::SectionData`], and as
    /// [`OrcTable::parse`].
    pub fn from_vmlinux(vmlinux: &Vmlinux) -> Result<Self, OrcTableError> {
        let bytes = |name: &'static str| {
            vmlinux.section_data(name).map_err(|source| match source {
                ImageError::NoSection(name) => OrcTableError::MissingSection(name),
                source => OrcTableError::SectionData { name, source },
            })
        };
        let ip_addr = vmlinux
            .section(".orc_unwind_ip")
            .ok_or(OrcTableError::MissingSection(".orc_unwind_ip"))?
            .addr;
        let header = match vmlinux.section(".orc_header") {
            Some(_) => Some(bytes(".orc_header")?),
            None => None,
        };
        Self::parse(
            bytes(".orc_unwind_ip")?,
            ip_addr,
            bytes(".orc_unwind")?,
            header,
        )
    }

    fn from_parts(
        ip_table: &[u8],
        ip_table_addr: u64,
        entries: Vec<RawOrcEntry>,
        layout: OrcLayout,
    ) -> Result<Self, OrcTableError> {
        if !ip_table.len().is_multiple_of(IP_SIZE) {
            return Err(OrcTableError::IpTableLength {
                len: ip_table.len(),
            });
        }
        let count = ip_table.len() / IP_SIZE;
        if count != entries.len() {
            return Err(OrcTableError::LengthMismatch {
                ips: count,
                entries: entries.len(),
            });
        }
        if count == 0 {
            return Err(OrcTableError::Empty);
        }
        let mut ips = Vec::with_capacity(count);
        for (index, chunk) in ip_table.chunks_exact(IP_SIZE).enumerate() {
            let relative = i32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
            let ip = u64::try_from(index * IP_SIZE)
                .ok()
                .and_then(|offset| ip_table_addr.checked_add(offset))
                .and_then(|slot| slot.checked_add_signed(i64::from(relative)))
                .ok_or(OrcTableError::IpOutOfRange { index })?;
            if let Some(&prev) = ips.last() {
                if ip < prev {
                    return Err(OrcTableError::Unsorted { index, ip, prev });
                }
            }
            ips.push(ip);
        }
        Ok(Self {
            ips,
            entries,
            layout,
            header: None,
        })
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.ips.len()
    }

    /// Whether there are no entries (never true for a parsed table).
    pub fn is_empty(&self) -> bool {
        self.ips.is_empty()
    }

    /// The layout the entries are decoded with.
    pub fn layout(&self) -> OrcLayout {
        self.layout
    }

    /// The `.orc_header` hash, when the image has one.
    pub fn header(&self) -> Option<&[u8; HEADER_SIZE]> {
        self.header.as_ref()
    }

    /// The first and the last ip that has an entry.
    pub fn ip_range(&self) -> (u64, u64) {
        (
            self.ips.first().copied().unwrap_or_default(),
            self.ips.last().copied().unwrap_or_default(),
        )
    }

    /// Whether `addr` lies between the first and the last entry's ip.
    pub fn covers(&self, addr: u64) -> bool {
        let (first, last) = self.ip_range();
        !self.is_empty() && (first..=last).contains(&addr)
    }

    /// The entry in force at `addr`: the last one whose ip is at or below it (the rightmost
    /// of equal ips, as the kernel's `__orc_find`, so real entries win over the weak
    /// terminators sorted before them), with that ip.
    pub fn lookup(&self, addr: u64) -> Option<(u64, OrcEntry)> {
        let index = self.ips.partition_point(|&ip| ip <= addr).checked_sub(1)?;
        let ip = *self.ips.get(index)?;
        let entry = self.entries.get(index)?.decode(self.layout);
        Some((ip, entry))
    }

    /// Every entry with its ip, in address order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, OrcEntry)> + '_ {
        self.ips
            .iter()
            .zip(&self.entries)
            .map(|(&ip, raw)| (ip, raw.decode(self.layout)))
    }
}

fn parse_header(header: &[u8]) -> Result<[u8; HEADER_SIZE], OrcTableError> {
    header
        .try_into()
        .map_err(|_| OrcTableError::HeaderLength { len: header.len() })
}

fn parse_entries(entries: &[u8]) -> Result<Vec<RawOrcEntry>, OrcTableError> {
    if !entries.len().is_multiple_of(ENTRY_SIZE) {
        return Err(OrcTableError::EntryTableLength { len: entries.len() });
    }
    Ok(entries
        .chunks_exact(ENTRY_SIZE)
        .map(|chunk| {
            RawOrcEntry::from_bytes([chunk[0], chunk[1], chunk[2], chunk[3], chunk[4], chunk[5]])
        })
        .collect())
}

/// Builds table bytes for tests and the fuzz target: `(ip, entry)` pairs laid out as the
/// kernel's sections at `ip_table_addr`.
///
/// # Errors
/// [`OrcTableError::IpOutOfRange`] when an ip is more than ±2 GiB from its slot.
pub fn encode_tables(
    ip_table_addr: u64,
    rows: &[(u64, RawOrcEntry)],
) -> Result<(Vec<u8>, Vec<u8>), OrcTableError> {
    let mut ips = Vec::with_capacity(rows.len() * IP_SIZE);
    let mut entries = Vec::with_capacity(rows.len() * ENTRY_SIZE);
    for (index, (ip, entry)) in rows.iter().enumerate() {
        let slot = u64::try_from(index * IP_SIZE)
            .ok()
            .and_then(|offset| ip_table_addr.checked_add(offset))
            .ok_or(OrcTableError::IpOutOfRange { index })?;
        let relative = i32::try_from(ip.wrapping_sub(slot) as i64)
            .map_err(|_| OrcTableError::IpOutOfRange { index })?;
        ips.extend_from_slice(&relative.to_le_bytes());
        entries.extend_from_slice(&entry.to_bytes());
    }
    Ok((ips, entries))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::orc::entry::{OrcReg, OrcType, KNOWN_HEADERS};
    use crate::orc::testing::{call, end_of_stack, TEXT};

    const IP_TABLE: u64 = 0xffff_ffff_8200_0000;

    fn table(rows: &[(u64, RawOrcEntry)]) -> Result<OrcTable, OrcTableError> {
        let (ips, entries) = encode_tables(IP_TABLE, rows).unwrap();
        OrcTable::parse(&ips, IP_TABLE, &entries, None)
    }

    #[test]
    fn parse_resolves_pc_relative_ips() {
        let rows = [(TEXT, call(8)), (TEXT + 0x10, call(16))];

        let parsed = table(&rows).unwrap();

        assert_eq!(parsed.ip_range(), (TEXT, TEXT + 0x10));
    }

    #[test]
    fn lookup_takes_the_last_entry_at_or_below_the_address() {
        let parsed = table(&[(TEXT, call(8)), (TEXT + 0x10, call(16))]).unwrap();

        let found = [TEXT, TEXT + 0xf, TEXT + 0x10, TEXT + 0x1000].map(|addr| {
            parsed
                .lookup(addr)
                .map(|(ip, entry)| (ip - TEXT, entry.sp_offset))
        });

        assert_eq!(
            found,
            [
                Some((0, 8)),
                Some((0, 8)),
                Some((0x10, 16)),
                Some((0x10, 16))
            ]
        );
    }

    #[test]
    fn lookup_below_the_first_entry_finds_nothing() {
        let parsed = table(&[(TEXT, call(8))]).unwrap();

        let found = parsed.lookup(TEXT - 1);

        assert_eq!(found, None);
    }

    #[test]
    fn lookup_prefers_the_rightmost_of_equal_ips() {
        let terminator = RawOrcEntry::default();
        let parsed = table(&[(TEXT, terminator), (TEXT, call(24))]).unwrap();

        let (_, entry) = parsed.lookup(TEXT).unwrap();

        assert_eq!((entry.kind, entry.sp_offset), (OrcType::Call, 24));
    }

    #[test]
    fn parse_refuses_unsorted_ips() {
        let err = table(&[(TEXT + 0x10, call(8)), (TEXT, call(8))]).unwrap_err();

        assert!(matches!(err, OrcTableError::Unsorted { index: 1, .. }));
    }

    #[test]
    fn parse_refuses_truncated_ip_table() {
        let (ips, entries) = encode_tables(IP_TABLE, &[(TEXT, call(8))]).unwrap();

        let err = OrcTable::parse(&ips[..3], IP_TABLE, &entries, None).unwrap_err();

        assert!(matches!(err, OrcTableError::IpTableLength { len: 3 }));
    }

    #[test]
    fn parse_refuses_truncated_entry_table() {
        let (ips, entries) = encode_tables(IP_TABLE, &[(TEXT, call(8))]).unwrap();

        let err = OrcTable::parse(&ips, IP_TABLE, &entries[..5], None).unwrap_err();

        assert!(matches!(err, OrcTableError::EntryTableLength { len: 5 }));
    }

    #[test]
    fn parse_refuses_tables_of_different_lengths() {
        let (ips, entries) =
            encode_tables(IP_TABLE, &[(TEXT, call(8)), (TEXT + 4, call(8))]).unwrap();

        let err = OrcTable::parse(&ips, IP_TABLE, &entries[..6], None).unwrap_err();

        assert!(matches!(
            err,
            OrcTableError::LengthMismatch { ips: 2, entries: 1 }
        ));
    }

    #[test]
    fn parse_refuses_empty_tables() {
        let err = OrcTable::parse(&[], IP_TABLE, &[], None).unwrap_err();

        assert!(matches!(err, OrcTableError::Empty));
    }

    #[test]
    fn parse_refuses_an_ip_past_the_address_space() {
        let ips = i32::MAX.to_le_bytes();
        let entries = call(8).to_bytes();

        let err = OrcTable::parse(&ips, u64::MAX - 3, &entries, None).unwrap_err();

        assert!(matches!(err, OrcTableError::IpOutOfRange { index: 0 }));
    }

    #[test]
    fn parse_refuses_an_unknown_header_hash() {
        let (ips, entries) = encode_tables(IP_TABLE, &[(TEXT, call(8))]).unwrap();

        let err = OrcTable::parse(&ips, IP_TABLE, &entries, Some(&[0x5a; 20])).unwrap_err();

        assert_eq!(
            err.to_string(),
            ".orc_header hash 5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a is not a known \
             struct orc_entry layout (a kernel newer than this reader?)"
        );
    }

    #[test]
    fn parse_refuses_a_header_of_the_wrong_size() {
        let (ips, entries) = encode_tables(IP_TABLE, &[(TEXT, call(8))]).unwrap();

        let err = OrcTable::parse(&ips, IP_TABLE, &entries, Some(&[0; 19])).unwrap_err();

        assert!(matches!(err, OrcTableError::HeaderLength { len: 19 }));
    }

    #[test]
    fn parse_takes_the_layout_from_a_known_header() {
        let (ips, entries) = encode_tables(IP_TABLE, &[(TEXT, call(8))]).unwrap();
        let (layout, hash) = KNOWN_HEADERS[0];

        let parsed = OrcTable::parse(&ips, IP_TABLE, &entries, Some(&hash)).unwrap();

        assert_eq!((parsed.layout(), parsed.header()), (layout, Some(&hash)));
    }

    #[test]
    fn parse_without_header_detects_the_4_14_layout() {
        let parsed = table(&[(TEXT, call(8)), (TEXT + 8, end_of_stack())]).unwrap();

        let (_, last) = parsed.lookup(TEXT + 8).unwrap();

        assert_eq!(
            (parsed.layout(), last.sp_reg, last.kind),
            (OrcLayout::Linux4_14, OrcReg::Undefined, OrcType::EndOfStack)
        );
    }

    #[test]
    fn from_elf_refuses_an_elf_without_orc_sections() {
        let mut obj = object::write::Object::new(
            object::BinaryFormat::Elf,
            object::Architecture::X86_64,
            object::Endianness::Little,
        );
        let text = obj.add_section(Vec::new(), b".text".to_vec(), object::SectionKind::Text);
        obj.append_section_data(text, &[0xc3], 1);
        let elf = obj.write().unwrap();

        let err = OrcTable::from_elf(&elf).unwrap_err();

        assert!(matches!(
            err,
            OrcTableError::MissingSection(".orc_unwind_ip")
        ));
    }

    #[test]
    fn from_elf_reads_the_orc_sections() {
        let (ips, entries) =
            encode_tables(0, &[(0x100, call(8)), (0x108, end_of_stack())]).unwrap();
        let mut obj = object::write::Object::new(
            object::BinaryFormat::Elf,
            object::Architecture::X86_64,
            object::Endianness::Little,
        );
        for (name, bytes) in [(".orc_unwind_ip", &ips), (".orc_unwind", &entries)] {
            let id = obj.add_section(
                Vec::new(),
                name.as_bytes().to_vec(),
                object::SectionKind::ReadOnlyData,
            );
            obj.append_section_data(id, bytes, 4);
        }
        let elf = obj.write().unwrap();

        let parsed = OrcTable::from_elf(&elf).unwrap();

        assert_eq!((parsed.len(), parsed.ip_range()), (2, (0x100, 0x108)));
    }
}
