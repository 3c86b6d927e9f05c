//! The hand-made entry splice of `exotap selftest`: a code patch that atomically increments a
//! 64-bit counter and then does what the function's 5-byte entry instruction did.
//!
//! Hand-encoded on purpose: it is the smoke test that proves the patch heap executes, so it
//! depends on nothing but the two instructions a traceable Linux function can start with after
//! boot: the ftrace nop (`nopl 0x0(%rax,%rax,1)`, `0f 1f 44 00 00`) or, while the guest's own
//! ftrace is on for it, `call rel32` to an ftrace trampoline. The general splice engine lives in
//! probes/src/splice.
//!
//! A relocated `call` is emitted as `push ORIGINAL_NEXT; jmp TARGET`: the callee sees the same
//! return address as without the splice, so ftrace attributes the hit to the right function,
//! the unwinder sees a real kernel address, and the return skips the patch.

/// The ftrace nop at a function's entry after boot.
pub const NOP5: [u8; 5] = [0x0f, 0x1f, 0x44, 0x00, 0x00];

/// Why an entry instruction cannot be relocated by this patch.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EntryPatchError {
    /// Not one of the two instructions a traced function starts with.
    #[error("the entry instruction {0:02x?} is neither the ftrace nop5 nor a call rel32")]
    Unsupported([u8; 5]),
    /// A rel32 does not reach.
    #[error("{from:#x} cannot reach {to:#x} with a rel32")]
    OutOfRange {
        /// Address after the jump or call.
        from: u64,
        /// Its target.
        to: u64,
    },
    /// An address is not in the top 2 GiB, so `push imm32` cannot produce it.
    #[error("{0:#x} is not a kernel-image address (push imm32 sign-extends)")]
    NotSignExtendable(u64),
}

fn rel32(next: u64, target: u64) -> Result<[u8; 4], EntryPatchError> {
    let delta = target.wrapping_sub(next) as i64;
    i32::try_from(delta)
        .map(i32::to_le_bytes)
        .map_err(|_| EntryPatchError::OutOfRange {
            from: next,
            to: target,
        })
}

/// `jmp rel32` at `at` to `target`.
///
/// # Errors
/// [`EntryPatchError::OutOfRange`] beyond ±2 GiB.
pub fn jmp_rel32(at: u64, target: u64) -> Result<[u8; 5], EntryPatchError> {
    let r = rel32(at.wrapping_add(5), target)?;
    Ok([0xe9, r[0], r[1], r[2], r[3]])
}

/// The out-of-line copy of the entry instruction `original` that was at `func`, placed at
/// `at`: the relocated instruction, then (for the nop) a jump back to `func + 5`. A vCPU
/// stopped at `func` resumes here to run the entry without the breakpoint or splice there.
///
/// # Errors
/// An unsupported entry instruction or an unreachable callee or return address.
pub fn relocated_entry(func: u64, original: [u8; 5], at: u64) -> Result<Vec<u8>, EntryPatchError> {
    let back = func.wrapping_add(5);
    let mut code = Vec::with_capacity(10);
    if original == NOP5 {
        code.extend_from_slice(&jmp_rel32(at, back)?);
    } else if original[0] == 0xe8 {
        let disp = i32::from_le_bytes([original[1], original[2], original[3], original[4]]);
        let callee = back.wrapping_add(disp as i64 as u64);
        let imm =
            i32::try_from(back as i64).map_err(|_| EntryPatchError::NotSignExtendable(back))?;
        code.push(0x68); // push imm32 (sign-extended): the original return address
        code.extend_from_slice(&imm.to_le_bytes());
        code.extend_from_slice(&jmp_rel32(at.wrapping_add(5), callee)?);
    } else {
        return Err(EntryPatchError::Unsupported(original));
    }
    Ok(code)
}

/// The code patch placed at `patch`: `lock incq counter(%rip)`, then the relocated entry
/// instruction (see [`relocated_entry`]).
///
/// Flags are clobbered by `lock inc`; at a function's entry they are dead (the ABI passes
/// nothing in them).
///
/// # Errors
/// As [`relocated_entry`], and an unreachable counter.
pub fn counter_patch(
    func: u64,
    original: [u8; 5],
    patch: u64,
    counter: u64,
) -> Result<Vec<u8>, EntryPatchError> {
    // lock incq disp32(%rip): f0 48 ff 05 disp32 (8 bytes).
    let mut code = vec![0xf0, 0x48, 0xff, 0x05];
    code.extend_from_slice(&rel32(patch.wrapping_add(8), counter)?);
    code.extend(relocated_entry(func, original, patch.wrapping_add(8))?);
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FUNC: u64 = 0xffff_ffff_810b_0d90;
    const PATCH: u64 = 0xffff_ffff_8400_0000;
    const COUNTER: u64 = 0xffff_ffff_8400_1000;

    #[test]
    fn nop5_patch_counts_then_jumps_back_after_the_entry() {
        let code = counter_patch(FUNC, NOP5, PATCH, COUNTER).unwrap();

        // lock incq (COUNTER - (PATCH+8))(%rip)
        assert_eq!(&code[..4], &[0xf0, 0x48, 0xff, 0x05]);
        let disp = i32::from_le_bytes(code[4..8].try_into().unwrap());
        assert_eq!(PATCH + 8 + disp as u64, COUNTER);
        assert_eq!(code[8], 0xe9);
        let back = i32::from_le_bytes(code[9..13].try_into().unwrap());
        assert_eq!((PATCH + 13).wrapping_add(back as i64 as u64), FUNC + 5);
        assert_eq!(code.len(), 13);
    }

    #[test]
    fn call_is_relocated_as_push_of_the_original_return_address_and_jmp() {
        let ftrace_caller: u64 = 0xffff_ffff_8100_2000;
        let call = jmp_rel32(FUNC, ftrace_caller).unwrap(); // same rel32 encoding as call
        let original = [0xe8, call[1], call[2], call[3], call[4]];

        let code = counter_patch(FUNC, original, PATCH, COUNTER).unwrap();

        assert_eq!(code[8], 0x68);
        let pushed = i32::from_le_bytes(code[9..13].try_into().unwrap()) as i64 as u64;
        assert_eq!(pushed, FUNC + 5);
        assert_eq!(code[13], 0xe9);
        let rel = i32::from_le_bytes(code[14..18].try_into().unwrap());
        assert_eq!((PATCH + 18).wrapping_add(rel as i64 as u64), ftrace_caller);
    }

    #[test]
    fn other_entry_instructions_are_refused() {
        let push_rbp_and_more = [0x55, 0x48, 0x89, 0xe5, 0x90];

        let err = counter_patch(FUNC, push_rbp_and_more, PATCH, COUNTER).unwrap_err();

        assert_eq!(err, EntryPatchError::Unsupported(push_rbp_and_more));
    }

    #[test]
    fn unreachable_counter_is_refused() {
        let far = PATCH.wrapping_sub(3 << 30);

        let err = counter_patch(FUNC, NOP5, PATCH, far).unwrap_err();

        assert!(matches!(err, EntryPatchError::OutOfRange { .. }), "{err}");
    }
}
