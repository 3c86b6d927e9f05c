//! KLAS join points: query parsing, and precision/recall against a traced run of
//! `testprogs/klas.c`.

use std::collections::{HashMap, HashSet};

use object::{Object, ObjectSymbol};

use super::facts::Layouts;
use super::tracer::{trace, TraceError};
use super::*;
use crate::dwarf::testing::{fixture, names};
use crate::dwarf::DebugFile;

#[test]
fn member_query_parses_struct_and_member_paths() {
    assert_eq!(
        MemberQuery::parse("struct file.f_pos").unwrap(),
        MemberQuery {
            struct_name: "file".into(),
            member: "f_pos".into()
        }
    );
    assert_eq!(MemberQuery::parse("sk_buff").unwrap().member, "");
    assert_eq!(
        MemberQuery::parse("file.f_path.dentry").unwrap().member,
        "f_path.dentry"
    );
    assert!(MemberQuery::parse("struct .x").is_err());
    assert!(MemberQuery::parse("file.f-pos").is_err());
}

#[test]
fn member_query_matches_nested_paths_of_the_member_only() {
    let q = MemberQuery::parse("file.f_path").unwrap();

    assert!(q.matches("file", "f_path"));
    assert!(q.matches("file", "f_path.dentry"));
    assert!(!q.matches("file", "f_path_x"));
    assert!(!q.matches("inode", "f_path"));
}

/// (pc, "struct.member") pairs.
type Sites = HashSet<(u64, String)>;

#[test]
fn join_points_of_the_test_program_match_its_traced_accesses() {
    let Some(path) = fixture("klas", &["-static", "-no-pie"]) else {
        return;
    };
    let file = DebugFile::open(&path).unwrap();
    let info = file.load().unwrap();
    let index = names(&info);
    let funcs: Vec<_> = index
        .iter()
        .filter(|e| e.kind == EntryKind::Function && e.file.ends_with("klas.c"))
        .collect();
    let elf = object::File::parse(file.bytes()).unwrap();
    let symbol = |name: &str| {
        elf.symbols()
            .find(|s| s.name() == Ok(name))
            .map(|s| (s.address(), s.size()))
            .unwrap()
    };
    let instances = [
        ("obj", symbol("objs")),
        ("ops", symbol("ops_a")),
        ("ops", symbol("ops_b")),
    ];
    let mut layouts = Layouts::default();
    let struct_die = |name: &str| {
        index
            .lookup_kind(name, EntryKind::Struct)
            .next()
            .unwrap()
            .die
    };
    let sizes: HashMap<&str, u64> = ["obj", "ops"]
        .iter()
        .map(|n| {
            (
                *n,
                crate::btf::cdecl::TypeShapes::size_of(
                    &info,
                    super::super::types::TypeRef::new(struct_die(n)),
                )
                .unwrap(),
            )
        })
        .collect();

    let globals = Globals::from_index(&info, &index);
    let mut ours: Sites = HashSet::new();
    let mut kinds: HashMap<u64, Access> = HashMap::new();
    for q in ["obj", "ops", "inner"] {
        for jp in info
            .join_points(&funcs, &globals, &MemberQuery::parse(q).unwrap())
            .unwrap()
        {
            kinds.insert(jp.addr, jp.access);
            ours.insert((jp.addr, jp.member));
        }
    }
    let ranges: Vec<(u64, u64)> = instances.iter().map(|(_, r)| *r).collect();
    let traced = match trace(&path, &ranges) {
        Ok(t) => t,
        Err(TraceError::NotPermitted(why)) => {
            println!("SKIP: ptrace is not permitted here ({why}); the KLAS program is not traced");
            return;
        }
        Err(TraceError::Failed(why)) => panic!("tracing {} failed: {why}", path.display()),
    };
    // The program ran (it exited 0 after its instructions were stepped): an empty trace is a
    // wrong one.
    assert!(
        !traced.touches.is_empty(),
        "single-stepping {} ran {} distinct instructions but saw no access to {ranges:x?}",
        path.display(),
        traced.executed.len()
    );
    let mut truth: Sites = HashSet::new();
    let mut writes: HashMap<u64, bool> = HashMap::new();
    for t in &traced.touches {
        let (name, (start, _)) = instances
            .iter()
            .find(|(_, (s, l))| t.addr >= *s && t.addr < s + l)
            .unwrap();
        let off = (t.addr - start) % sizes[name];
        let hit = layouts
            .member_at(&info, struct_die(name), off, t.size)
            .unwrap();
        // Through a pointer to the embedded `struct inner`, the access is to inner's member.
        let label = match hit.path.strip_prefix("in.") {
            Some(rest) if ours.contains(&(t.rip, format!("inner.{rest}"))) => {
                format!("inner.{rest}")
            }
            _ => format!("{name}.{}", hit.path),
        };
        truth.insert((t.rip, label));
        *writes.entry(t.rip).or_default() |= t.write;
    }

    let executed: Sites = ours
        .iter()
        .filter(|(pc, _)| traced.executed.contains(pc))
        .cloned()
        .collect();
    let found = truth.intersection(&ours).count();
    let correct = executed.intersection(&truth).count();
    let kind_ok = truth
        .intersection(&ours)
        .filter(|(pc, _)| {
            matches!(
                (kinds[pc], writes[pc]),
                (Access::Read | Access::Call, false) | (Access::Write | Access::ReadWrite, true)
            )
        })
        .count();
    let recall = found as f64 / truth.len() as f64;
    let precision = correct as f64 / executed.len() as f64;
    println!(
        "KLAS on testprogs/klas.c: {} executed member-access sites, {} found statically ({} not executed); \
         recall {recall:.3}, precision {precision:.3}, access kind right for {kind_ok}/{found}",
        truth.len(),
        ours.len(),
        ours.len() - executed.len()
    );
    let missed: Vec<_> = truth.difference(&ours).collect();
    let wrong: Vec<_> = executed.difference(&truth).collect();
    println!("missed: {missed:x?}\nwrong: {wrong:x?}");
    assert!(recall >= 0.9, "recall {recall}");
    assert!(precision >= 0.95, "precision {precision}");
    assert_eq!(kind_ok, found);
}

/// The tracer's failures are failures, never an empty trace: a program that cannot be
/// executed, and one that exits with an error.
#[test]
fn a_program_that_cannot_run_or_fails_under_the_tracer_is_an_error() {
    let missing = trace(std::path::Path::new("/nonexistent/exotap-klas"), &[]);
    if let Err(TraceError::NotPermitted(why)) = &missing {
        println!("SKIP: ptrace is not permitted here ({why}); the tracer is not checked");
        return;
    }
    let failing = trace(std::path::Path::new("/bin/false"), &[]);

    assert!(
        matches!(&missing, Err(TraceError::Failed(why)) if why.starts_with("execv /nonexistent/exotap-klas")),
        "{missing:?}"
    );
    assert!(
        matches!(&failing, Err(TraceError::Failed(why)) if why.contains("exited with status 1")),
        "{failing:?}"
    );
}
