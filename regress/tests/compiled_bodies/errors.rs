//! Guru writes, and probe errors: division by zero, the statement budget, faulting reads, an
//! array past its size.

use super::*;

#[test]
fn guru_writes_to_parameters_reach_the_registers_the_function_runs_with() {
    let limits = Limits::default();
    let guru = Invocation {
        guru: true,
        ..Invocation::default()
    };
    let (mut rig, _) = rig_as(
        r#"probe kernel.function("f") { $a = $a * 3 + 1; $b -= 5 }"#,
        &limits,
        &guru,
    );
    let hit = Hit {
        comm: "t",
        pid: 1,
        tgid: 1,
        a: 14,
        b: -2,
    };

    rig.hit(&hit);

    let RegisterFile::X86_64(regs) = rig.uc.registers(exotap_vmm::unicorn::VCPU).unwrap() else {
        panic!("not x86")
    };
    // The script's arithmetic on the hit's arguments: rdi = 14 * 3 + 1, rsi = -2 - 5.
    assert_eq!(
        (regs.gpr[5] as i64, regs.gpr[4] as i64),
        (hit.a * 3 + 1, hit.b - 5)
    );
}

#[test]
fn writes_to_target_variables_are_refused_without_guru_mode() {
    let refused = check_script(
        &ScriptSource {
            name: "t.stp".into(),
            text: r#"probe kernel.function("f") { $a = 1 }"#.into(),
        },
        &Limits::default(),
    )
    .unwrap_err();

    assert!(
        refused[0]
            .message
            .contains("cannot write target variable '$a'"),
        "{refused:?}"
    );
}

#[test]
fn a_division_by_zero_ends_the_hit_with_a_probe_error() {
    let limits = Limits::default();
    let (mut rig, _) = rig(
        r#"global z, after; probe kernel.function("f") { z = 10 / $a; after++ }"#,
        &limits,
    );
    let hit = |a| Hit {
        comm: "t",
        pid: 1,
        tgid: 1,
        a,
        b: 0,
    };

    rig.hit(&hit(0));
    rig.hit(&hit(5));
    rig.hit(&hit(-1));

    let data = rig.data();
    let header = Header::decode(&data);
    assert_eq!((header.errors, header.div_zero), (1, 1));
    assert_eq!(
        format!("{:?}", rig.layout.decode("after", &data, &rig.interner)),
        "Some(Scalar(Long(2)))",
        "the hit with the error stopped there"
    );
}

#[test]
fn an_endless_loop_runs_out_of_its_statement_budget() {
    let limits = Limits::default();
    let (mut rig, _) = rig(r#"probe kernel.function("f") { while (1) {} }"#, &limits);

    rig.hit(&Hit {
        comm: "t",
        pid: 1,
        tgid: 1,
        a: 0,
        b: 0,
    });

    let header = Header::decode(&rig.data());
    assert_eq!((header.errors, header.max_action), (1, 1));
}

#[test]
fn a_faulting_kernel_read_is_a_probe_error_and_a_good_one_reads() {
    let limits = Limits::default();
    let (mut rig, _) = rig(
        r#"global v; probe kernel.function("f") { v = kernel_long($a) + kernel_int($a + 8) }"#,
        &limits,
    );
    rig.uc.write(TASK + 0x800, &7i64.to_le_bytes()).unwrap();
    rig.uc.write(TASK + 0x808, &(-2i32).to_le_bytes()).unwrap();

    rig.hit(&Hit {
        comm: "t",
        pid: 1,
        tgid: 1,
        a: 0,
        b: 0,
    });
    rig.hit(&Hit {
        comm: "t",
        pid: 1,
        tgid: 1,
        a: (TASK + 0x800) as i64,
        b: 0,
    });

    let data = rig.data();
    let header = Header::decode(&data);
    assert_eq!((header.errors, header.faults), (1, 1));
    assert_eq!(
        format!("{:?}", rig.layout.decode("v", &data, &rig.interner)),
        "Some(Scalar(Long(5)))"
    );
}

#[test]
fn an_array_past_its_size_overflows_with_a_probe_error_as_in_the_interpreter() {
    let script = r#"global a[4]; probe kernel.function("f") { a[$a]++; if ($a % 2) delete a[$a] }"#;
    let hits: Vec<Hit> = (0..100)
        .map(|a| Hit {
            comm: "t",
            pid: 1,
            tgid: 1,
            a,
            b: 0,
        })
        .collect();

    let (header, interpreter_errors) = differential_with(script, &hits);

    // Odd keys go at once, 0, 2, 4 and 6 stay: a[7] is the first insert into a full array.
    assert_eq!(interpreter_errors, 93);
    assert_eq!(
        (header.overflow, header.errors, header.dropped),
        (93, 93, 0)
    );
}
