//! Tests of the BTF reader on blobs built here, and on the Debian kernel's own `.BTF`.

use super::cdecl::{declaration, ptype};
use super::*;

/// Builds a BTF blob: types as raw u32 words, strings appended with their offsets returned.
#[derive(Default)]
struct Builder {
    words: Vec<u32>,
    strings: Vec<u8>,
    big_endian: bool,
}

impl Builder {
    fn new() -> Self {
        Builder {
            words: Vec::new(),
            strings: vec![0],
            big_endian: false,
        }
    }

    fn s(&mut self, text: &str) -> u32 {
        let at = u32::try_from(self.strings.len()).unwrap();
        self.strings.extend_from_slice(text.as_bytes());
        self.strings.push(0);
        at
    }

    fn ty(
        &mut self,
        name: &str,
        kind: u32,
        vlen: u32,
        kind_flag: bool,
        size_or_type: u32,
        tail: &[u32],
    ) {
        let name = if name.is_empty() { 0 } else { self.s(name) };
        let info = vlen | kind << 24 | u32::from(kind_flag) << 31;
        self.words.extend_from_slice(&[name, info, size_or_type]);
        self.words.extend_from_slice(tail);
    }

    fn blob(&self) -> Vec<u8> {
        let enc = |v: u32| {
            if self.big_endian {
                v.to_be_bytes()
            } else {
                v.to_le_bytes()
            }
        };
        let type_len = u32::try_from(self.words.len() * 4).unwrap();
        let str_len = u32::try_from(self.strings.len()).unwrap();
        let mut out = Vec::new();
        out.extend_from_slice(&if self.big_endian {
            0xeb9fu16.to_be_bytes()
        } else {
            0xeb9fu16.to_le_bytes()
        });
        out.extend_from_slice(&[1, 0]);
        for v in [24, 0, type_len, type_len, str_len] {
            out.extend_from_slice(&enc(v));
        }
        for &w in &self.words {
            out.extend_from_slice(&enc(w));
        }
        out.extend_from_slice(&self.strings);
        out
    }
}

/// A small kernel-like type graph:
/// 1 int, 2 char, 3 `pid_t` = int, 4 `const char`, 5 char[16], 6 `struct list_head`,
/// 7 `struct list_head *`, 8 anonymous union { int a; pid_t b; }, 9 `struct task`,
/// 10 `const struct task *`, 11 proto int(const struct task *, ...), 12 func `task_pid`.
fn task_blob(b: &mut Builder) -> Vec<u8> {
    b.ty("int", 1, 0, false, 4, &[1 << 24 | 32]);
    b.ty("char", 1, 0, false, 1, &[2 << 24 | 8]);
    b.ty("pid_t", 8, 0, false, 1, &[]);
    b.ty("", 10, 0, false, 2, &[]);
    b.ty("", 3, 0, false, 0, &[2, 1, 16]);
    let next = b.s("next");
    let prev = b.s("prev");
    b.ty("list_head", 4, 2, false, 16, &[next, 7, 0, prev, 7, 64]);
    b.ty("", 2, 0, false, 6, &[]);
    let a = b.s("a");
    let bb = b.s("b");
    b.ty("", 5, 2, false, 4, &[a, 1, 0, bb, 3, 0]);
    let (pid, comm, tasks, flags, state) = (
        b.s("pid"),
        b.s("comm"),
        b.s("tasks"),
        b.s("flags"),
        b.s("state"),
    );
    // kind_flag: offsets carry bitfield sizes in their top byte.
    b.ty(
        "task",
        4,
        6,
        true,
        64,
        &[
            pid,
            3,
            0,
            comm,
            5,
            32,
            tasks,
            6,
            192,
            0,
            8,
            320,
            flags,
            1,
            3 << 24 | 352,
            state,
            1,
            5 << 24 | 355,
        ],
    );
    b.ty("", 10, 0, false, 9, &[]);
    b.ty("", 2, 0, false, 10, &[]);
    let t = b.s("t");
    b.ty("", 13, 2, false, 1, &[t, 11, 0, 0]);
    b.ty("task_pid", 12, 1, false, 12, &[]);
    b.blob()
}

fn task_btf() -> Btf {
    Btf::parse(&task_blob(&mut Builder::new())).unwrap()
}

#[test]
fn parse_reads_every_type_and_names() {
    let btf = task_btf();

    assert_eq!(btf.len(), 14);
    assert_eq!(btf.name(9), "task");
    assert_eq!(
        btf.get(5).map(|t| &t.kind),
        Some(&Kind::Array {
            elem: 2,
            index: 1,
            len: 16
        })
    );
}

#[test]
fn struct_member_gives_byte_offsets_of_plain_members() {
    let btf = task_btf();

    let pid = btf.struct_member("task", "pid").unwrap();
    let comm = btf.struct_member("task", "comm").unwrap();
    let tasks = btf.struct_member("task", "tasks").unwrap();

    assert_eq!((pid.byte_offset(), pid.ty), (Some(0), 3));
    assert_eq!((comm.byte_offset(), comm.ty), (Some(4), 5));
    assert_eq!((tasks.byte_offset(), tasks.ty), (Some(24), 6));
}

#[test]
fn struct_member_follows_paths_subscripts_and_anonymous_unions() {
    let btf = task_btf();

    let prev = btf.struct_member("task", "tasks.prev").unwrap();
    let third = btf.struct_member("task", "comm[3]").unwrap();
    let anon = btf.struct_member("task", "b").unwrap();

    assert_eq!(prev.byte_offset(), Some(32));
    assert_eq!((third.byte_offset(), third.ty), (Some(7), 2));
    assert_eq!((anon.byte_offset(), anon.ty), (Some(40), 3));
}

#[test]
fn kind_flag_members_carry_bitfield_sizes() {
    let btf = task_btf();

    let state = btf.struct_member("task", "state").unwrap();

    assert_eq!(
        (state.bit_offset, state.bitfield_size, state.byte_offset()),
        (355, Some(5), None)
    );
}

#[test]
fn struct_member_names_the_missing_step() {
    let btf = task_btf();

    assert_eq!(
        btf.struct_member("task", "tasks.nope"),
        Err(LookupError::NoSuchMember {
            path: "task.tasks".into(),
            member: "nope".into()
        })
    );
    assert_eq!(
        btf.struct_member("task", "pid[1]"),
        Err(LookupError::NotArray("task.pid".into()))
    );
    assert_eq!(
        btf.struct_member("task", "pid.x").map(|_| ()),
        Err(LookupError::NotAggregate {
            path: "task.pid".into(),
            member: "x".into()
        })
    );
    assert!(matches!(
        btf.struct_member("nothing", "pid"),
        Err(LookupError::NoSuchType { .. })
    ));
}

#[test]
fn resolve_and_size_of_see_through_typedefs_and_qualifiers() {
    let btf = task_btf();

    assert_eq!(btf.resolve(3).unwrap(), 1);
    assert_eq!(btf.resolve(4).unwrap(), 2);
    assert_eq!(btf.size_of(3), Some(4));
    assert_eq!(btf.size_of(5), Some(16));
    assert_eq!(btf.size_of(7), Some(8));
    assert_eq!(btf.size_of(9), Some(64));
    assert_eq!(btf.size_of(0), None);
}

#[test]
fn func_signature_lists_parameters_and_variadic_tail() {
    let btf = task_btf();

    let sig = btf.func_signature("task_pid").unwrap();

    assert_eq!(sig.ret, 1);
    assert_eq!(sig.params, vec![("t".to_owned(), 11)]);
    assert!(sig.variadic);
}

#[test]
fn declarations_print_like_gdb() {
    let btf = task_btf();

    assert_eq!(declaration(&btf, 5, "comm"), "char comm[16]");
    assert_eq!(declaration(&btf, 11, "t"), "const struct task *t");
    assert_eq!(
        declaration(&btf, 13, "task_pid"),
        "int task_pid(const struct task *, ...)"
    );
}

#[test]
fn ptype_prints_the_struct_body() {
    let btf = task_btf();

    let text = ptype(&btf, 9, false);

    let expected = "type = struct task {\n    pid_t pid;\n    char comm[16];\n    struct list_head tasks;\n    \
                    union {\n        int a;\n        pid_t b;\n    };\n    int flags : 3;\n    int state : 5;\n}\n";
    assert_eq!(text, expected);
}

#[test]
fn big_endian_blobs_parse_the_same() {
    let mut b = Builder {
        big_endian: true,
        ..Builder::new()
    };
    let btf = Btf::parse(&task_blob(&mut b)).unwrap();

    assert_eq!(
        btf.struct_member("task", "tasks").unwrap().byte_offset(),
        Some(24)
    );
}

#[test]
fn parse_refuses_a_bad_magic_and_version() {
    let mut blob = task_blob(&mut Builder::new());
    blob[2] = 2;
    assert!(matches!(Btf::parse(&blob), Err(BtfError::BadVersion(2))));
    assert!(matches!(Btf::parse(b"ELF\x7f"), Err(BtfError::BadMagic(_))));
    assert!(matches!(Btf::parse(&[]), Err(BtfError::Truncated { .. })));
}

#[test]
fn parse_refuses_dangling_type_and_string_references() {
    let mut b = Builder::new();
    b.ty("", 2, 0, false, 7, &[]);
    assert!(matches!(
        Btf::parse(&b.blob()),
        Err(BtfError::BadReference {
            id: 1,
            target: 7,
            count: 1
        })
    ));

    let mut b = Builder::new();
    b.words.extend_from_slice(&[999, 2 << 24, 0]);
    assert!(matches!(
        Btf::parse(&b.blob()),
        Err(BtfError::BadString { id: 1, offset: 999 })
    ));
}

#[test]
fn parse_refuses_unknown_kinds_and_huge_member_counts() {
    let mut b = Builder::new();
    b.ty("", 31, 0, false, 0, &[]);
    assert!(matches!(
        Btf::parse(&b.blob()),
        Err(BtfError::UnknownKind { id: 1, kind: 31 })
    ));

    let mut b = Builder::new();
    b.ty("", 4, 0xffff, false, 8, &[]);
    assert!(matches!(
        Btf::parse(&b.blob()),
        Err(BtfError::Truncated { .. })
    ));
}

#[test]
fn every_truncation_and_byte_flip_of_a_blob_is_an_error_or_a_graph_not_a_panic() {
    let blob = task_blob(&mut Builder::new());
    for len in 0..blob.len() {
        let _ = Btf::parse(&blob[..len]);
    }
    for at in 0..blob.len() {
        let mut bad = blob.clone();
        bad[at] ^= 0xa5;
        if let Ok(btf) = Btf::parse(&bad) {
            for (id, _) in btf.iter() {
                let _ = ptype(&btf, id, true);
                let _ = btf.size_of(id);
            }
            let _ = btf.struct_member("task", "tasks.prev");
        }
    }
}

#[test]
fn typedef_loops_end_in_too_deep() {
    let mut b = Builder::new();
    b.ty("a", 8, 0, false, 2, &[]);
    b.ty("b", 10, 0, false, 1, &[]);
    let btf = Btf::parse(&b.blob()).unwrap();

    assert_eq!(btf.resolve(1), Err(LookupError::TooDeep(1)));
    assert_eq!(btf.size_of(1), None);
    assert!(declaration(&btf, 1, "x").contains('?') || declaration(&btf, 1, "x") == "a x");
}

#[test]
fn debian_kernel_btf_gives_task_struct_offsets() {
    let Some(vmlinux) = crate::bzimage::tests::real_vmlinux() else {
        return;
    };

    let btf = Btf::from_elf(vmlinux.bytes()).unwrap();
    let pid = btf.struct_member("task_struct", "pid").unwrap();
    let comm = btf.struct_member("task_struct", "comm").unwrap();
    let tasks = btf.struct_member("task_struct", "tasks").unwrap();

    println!(
        "task_struct: pid at {:?}, comm at {:?}, tasks at {:?} ({} types)",
        pid.byte_offset(),
        comm.byte_offset(),
        tasks.byte_offset(),
        btf.len()
    );
    assert_eq!(btf.name(pid.ty), "pid_t");
    assert_eq!(declaration(&btf, comm.ty, "comm"), "char comm[16]");
    assert_eq!(
        declaration(&btf, tasks.ty, "tasks"),
        "struct list_head tasks"
    );
    assert!(pid.byte_offset().is_some_and(|o| o > 0 && o < 4096));
    assert!(btf.func_signature("vfs_read").unwrap().params.len() == 4);
}

#[test]
fn split_btf_continues_its_bases_ids_and_strings() {
    let base = task_btf();
    let shift = u32::try_from(base.strings.len()).unwrap();
    // A module's BTF: its own strings (offsets past the base's) and types (ids past the
    // base's), `struct wrapper { struct task *t; pid_t n; }` over the base's `task`.
    let mut b = Builder {
        strings: Vec::new(),
        ..Builder::default()
    };
    let (wrapper, t, n) = (b.s("wrapper") + shift, b.s("t") + shift, b.s("n") + shift);
    let ptr = u32::try_from(base.len()).unwrap();
    b.words.extend_from_slice(&[0, 2 << 24, 9]); // PTR -> task (base id 9)
    b.words
        .extend_from_slice(&[wrapper, 4 << 24 | 2, 16, t, ptr, 0, n, 3, 64]);
    let split = Btf::parse_split(&b.blob(), &base).unwrap();
    assert_eq!(split.len(), base.len() + 2);
    let member_t = split.struct_member("wrapper", "t").unwrap();
    assert_eq!(split.get(member_t.ty).map(|t| &t.kind), Some(&Kind::Ptr(9)));
    assert_eq!(split.name(9), "task");
    let member_n = split.struct_member("wrapper", "n").unwrap();
    assert_eq!((member_n.byte_offset(), member_n.ty), (Some(8), 3));
    // The base's own types are all there, and the base alone has no `wrapper`.
    assert_eq!(
        split.struct_member("task", "pid").unwrap().byte_offset(),
        Some(0)
    );
    assert!(base.struct_member("wrapper", "n").is_err());
    // Parsed alone, its references to the base's types and strings do not resolve.
    assert!(Btf::parse(&b.blob()).is_err());
}
