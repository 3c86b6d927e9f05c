//! The join points of a query kept on disk: the whole-kernel pass of
//! [`super::join_points_everywhere`] takes 12 s on two cores for the Debian kernel (about 44,000
//! functions' data flow), and its answer depends only on the debug file, the query and this
//! analysis. A cache entry is named by all three: the debug file's build-id, the query, and a
//! hash of this analysis' own source text (`klas/*.rs`, compiled in), so that a changed
//! analysis never reads an older one's answers. A missing, unreadable or malformed entry is
//! found again and rewritten; an entry that cannot be written is only logged.
//!
//! An entry is text, one join point per line: `addr access line function file member`,
//! tab-separated (none of the fields holds a tab or a newline).

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

use super::{join_points_everywhere, Access, JoinPoint, KlasError, MemberQuery};
use crate::dwarf::index::Index;
use crate::dwarf::DebugInfo;

/// The analysis' source, which names the entries (a change to it is a new name).
const SOURCE: &[&str] = &[
    include_str!("mod.rs"),
    include_str!("facts.rs"),
    include_str!("flow.rs"),
    include_str!("tracer.rs"),
    include_str!("cache.rs"),
];

/// Where the entry for `build_id` and `query` is under `dir`.
fn entry(dir: &Path, build_id: &[u8], query: &MemberQuery) -> PathBuf {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    SOURCE.hash(&mut h);
    query.struct_name.hash(&mut h);
    query.member.hash(&mut h);
    let id: String = build_id.iter().map(|b| format!("{b:02x}")).collect();
    dir.join(format!("klas-{id}-{:016x}.tsv", h.finish()))
}

fn access_name(a: Access) -> &'static str {
    match a {
        Access::Read => "read",
        Access::Write => "write",
        Access::ReadWrite => "read-write",
        Access::Call => "call",
    }
}

fn parse_access(s: &str) -> Option<Access> {
    Some(match s {
        "read" => Access::Read,
        "write" => Access::Write,
        "read-write" => Access::ReadWrite,
        "call" => Access::Call,
        _ => return None,
    })
}

/// The text of an entry.
fn encode(points: &[JoinPoint]) -> String {
    points
        .iter()
        .map(|p| {
            format!(
                "{:x}\t{}\t{}\t{}\t{}\t{}\n",
                p.addr,
                access_name(p.access),
                p.line,
                p.function,
                p.file,
                p.member
            )
        })
        .collect()
}

/// The join points of an entry's text; `None` when any line is malformed.
fn decode(text: &str) -> Option<Vec<JoinPoint>> {
    text.lines()
        .map(|l| {
            let mut f = l.split('\t');
            let point = JoinPoint {
                addr: u64::from_str_radix(f.next()?, 16).ok()?,
                access: parse_access(f.next()?)?,
                line: f.next()?.parse().ok()?,
                function: f.next()?.to_owned(),
                file: f.next()?.to_owned(),
                member: f.next()?.to_owned(),
            };
            f.next().is_none().then_some(point)
        })
        .collect()
}

/// [`join_points_everywhere`], answered from the entry under `dir` when there is one, found
/// and kept there otherwise. A debug file without a build-id is analysed every time.
///
/// # Errors
/// As [`join_points_everywhere`].
pub fn join_points_cached(
    bytes: &[u8],
    index: &Index,
    query: &MemberQuery,
    dir: &Path,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<Vec<JoinPoint>, KlasError> {
    let info = DebugInfo::new(bytes)?;
    let Some(build_id) = info.build_id() else {
        return join_points_everywhere(bytes, index, query, progress);
    };
    let path = entry(dir, build_id, query);
    if let Some(points) = std::fs::read_to_string(&path)
        .ok()
        .as_deref()
        .and_then(decode)
    {
        tracing::debug!("join points of {query:?} from {}", path.display());
        return Ok(points);
    }
    let points = join_points_everywhere(bytes, index, query, progress)?;
    let tmp = path.with_extension(format!("{}.tmp", std::process::id()));
    let written = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&tmp, encode(&points)))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        tracing::debug!("the join points are not kept in {}: {e}", path.display());
    }
    Ok(points)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(addr: u64, access: Access) -> JoinPoint {
        JoinPoint {
            addr,
            function: "<ksys_read+119>".into(),
            file: "fs/read_write.c".into(),
            line: 615,
            access,
            member: "file.f_pos".into(),
        }
    }

    #[test]
    fn an_entry_reads_back_as_written() {
        let points = vec![
            point(0xffff_ffff_8134_a537, Access::Write),
            point(0xffff_ffff_8134_a540, Access::ReadWrite),
            point(0xffff_ffff_8134_a600, Access::Call),
        ];

        assert_eq!(decode(&encode(&points)), Some(points));
    }

    #[test]
    fn a_malformed_entry_is_not_an_answer() {
        let good = encode(&[point(0x10, Access::Read)]);

        for bad in [
            good.replace("read", "reed"),
            good.replace('\t', " "),
            format!("{}\textra", good.trim_end()),
            "zz\tread\t1\tf\tfile\tm".to_owned(),
        ] {
            assert_eq!(decode(&bad), None, "{bad:?}");
        }
    }

    #[test]
    fn entries_are_named_by_build_id_and_query() {
        let dir = Path::new("/c");
        let q = |t: &str| MemberQuery::parse(t).unwrap();
        let a = entry(dir, &[1, 2], &q("struct file.f_pos"));

        assert_eq!(a, entry(dir, &[1, 2], &q("file.f_pos")));
        assert_ne!(a, entry(dir, &[1, 3], &q("struct file.f_pos")));
        assert_ne!(a, entry(dir, &[1, 2], &q("struct file.f_mode")));
        assert!(a.to_string_lossy().starts_with("/c/klas-0102-"), "{a:?}");
    }
}
