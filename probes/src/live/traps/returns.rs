//! The return addresses the host-evaluated `.return` probes swapped, by stack slot: which
//! calls are in flight, what each slot held, and which of the recovery journal's entries
//! keeps it.
//!
//! A call's return address sits at one stack slot while the call is in flight; at the entry
//! hit the host swaps it for the trampoline, and the `ret` that pops the trampoline leaves the
//! stack pointer just above that slot, which names the call again.
//!
//! **Tail calls.** A probed function that ends in `jmp B` (a tail call, everywhere at -O2:
//! `proc_root_readdir` into `proc_pid_readdir`, `proc_root_lookup` into `proc_lookup`) enters B with
//! the same return-address slot, which A's entry has already swapped for the trampoline. B's
//! call is stacked above A's on that slot: the one `ret` that reaches the trampoline ends both,
//! and their return probes run innermost first (B's, then A's), as the kernel's kretprobes do
//! (`__kretprobe_trampoline_handler` walks every instance down to the first real return
//! address). Only the bottom call holds the real return address, and only it is journaled.
//! Taking B's entry for a stale swap (the earlier rule) kept the trampoline as B's "original"
//! and forgot A's: the task returned into the trampoline a second time with nothing
//! recorded, and into its `ud2` once exotap detached (issue 40: SystemTap's
//! `para-callgraph.stp` and `callgraph.stp` over `*@fs/proc*.c`).
//!
//! **Stale swaps.** A slot recorded here that now holds anything but the trampoline belongs to
//! a call that never returned (its task exited inside it, and the stack is reused): it is
//! forgotten when a new call enters there.

use std::collections::HashMap;

use exotap_vmm::control::X86Registers;

use crate::lang::value::Value;

/// The most calls stacked on one slot by tail calls (a deeper chain misses its return probes).
pub const MAX_TAIL_CHAIN: usize = 64;
/// The most slots remembered as returned ([`Ledger::returned_to`]); past it the memory starts over.
const RECENT: usize = 1 << 16;

/// One call in flight: where it entered and what its return probes see of its entry.
#[derive(Debug, Clone)]
pub struct Call {
    /// The armed entry point.
    pub site: u64,
    pub entry_regs: X86Registers,
    /// The return probes' `@entry(...)` values, evaluated at this call's entry.
    pub entry_values: Vec<(usize, Result<Value, String>)>,
}

/// The calls stacked on one slot, bottom first, and what the slot held before the bottom
/// call's swap.
#[derive(Debug, Clone)]
pub struct Chain {
    /// The real return address.
    pub original: u64,
    /// The bottom call's entry in the journal's return list.
    pub index: usize,
    /// Bottom first; every call above the bottom entered through a tail call.
    pub calls: Vec<Call>,
}

/// What an entry hit must do to the stack slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// Journal `(slot, original)` at `index`, then write the trampoline into the slot.
    /// `stale` are journal entries of calls that never returned through this slot: free them.
    Swap { index: usize, stale: Vec<usize> },
    /// A tail call: the slot already holds the trampoline for the calls below; nothing to write.
    Chained,
    /// No room (journal full, or the tail chain at [`MAX_TAIL_CHAIN`]): the call's return
    /// probes do not run. `stale` as for `Swap`.
    Missed { stale: Vec<usize> },
    /// The slot holds the trampoline with no call recorded for it: leave it alone (what it
    /// returns to is not known here).
    Unaccounted,
}

/// What a stop at the trampoline ends.
#[derive(Debug, Clone)]
pub enum Return {
    /// The calls of the slot's chain (innermost last in `calls`) and where to resume.
    Calls(Chain),
    /// Nothing recorded for the slot: `fallback` is the return address the last call through
    /// the same slot went back to, if one did.
    Unaccounted { fallback: Option<u64> },
}

/// The calls in flight of the host-evaluated return probes, by stack slot.
#[derive(Debug)]
pub struct Ledger {
    chains: HashMap<u64, Chain>,
    /// Free entries of the journal's return list.
    free: Vec<usize>,
    /// Slot → the return address its last call went back to (the fallback of
    /// [`Return::Unaccounted`]).
    recent: HashMap<u64, u64>,
    /// Calls whose return probes did not run for lack of room.
    pub missed: u64,
    /// Calls that entered through a tail call and shared their caller's return.
    pub tail_calls: u64,
    /// Stops at the trampoline, and entries at a swapped slot, with no call recorded.
    pub unaccounted: u64,
}

impl Ledger {
    /// A ledger over journal entries `0..slots`.
    pub fn new(slots: usize) -> Self {
        Self {
            chains: HashMap::new(),
            free: (0..slots).rev().collect(),
            recent: HashMap::new(),
            missed: 0,
            tail_calls: 0,
            unaccounted: 0,
        }
    }

    /// Calls in flight (every call of every chain).
    pub fn len(&self) -> usize {
        self.chains.values().map(|c| c.calls.len()).sum()
    }

    /// Whether no call is in flight.
    pub fn is_empty(&self) -> bool {
        self.chains.is_empty()
    }

    /// A call enters with its return address at `slot`, which holds `now`; `trampoline` is
    /// what a swap writes there. Records the call and says what to write.
    pub fn enter(&mut self, slot: u64, now: u64, trampoline: u64, call: Call) -> Entry {
        if now == trampoline {
            return match self.chains.get_mut(&slot) {
                Some(chain) if chain.calls.len() < MAX_TAIL_CHAIN => {
                    chain.calls.push(call);
                    self.tail_calls += 1;
                    Entry::Chained
                }
                Some(_) => {
                    self.missed += 1;
                    Entry::Missed { stale: Vec::new() }
                }
                None => {
                    self.unaccounted += 1;
                    Entry::Unaccounted
                }
            };
        }
        let stale: Vec<usize> = self
            .chains
            .remove(&slot)
            .map(|c| c.index)
            .into_iter()
            .collect();
        self.free.extend(&stale);
        match self.free.pop() {
            Some(index) => {
                self.chains.insert(
                    slot,
                    Chain {
                        original: now,
                        index,
                        calls: vec![call],
                    },
                );
                Entry::Swap { index, stale }
            }
            None => {
                self.missed += 1;
                Entry::Missed { stale }
            }
        }
    }

    /// A vCPU stopped at the trampoline after `ret` popped `slot`: ends the slot's calls (the
    /// caller runs their return probes innermost first and frees the chain's journal entry).
    pub fn leave(&mut self, slot: u64) -> Return {
        match self.chains.remove(&slot) {
            Some(chain) => {
                self.free.push(chain.index);
                if self.recent.len() >= RECENT {
                    self.recent.clear();
                }
                self.recent.insert(slot, chain.original);
                Return::Calls(chain)
            }
            None => {
                self.unaccounted += 1;
                Return::Unaccounted {
                    fallback: self.recent.get(&slot).copied(),
                }
            }
        }
    }

    /// Every chain still in flight, by slot (for putting the return addresses back).
    pub fn drain(&mut self) -> impl Iterator<Item = (u64, Chain)> + '_ {
        self.free.extend(self.chains.values().map(|c| c.index));
        self.chains.drain()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRAMPOLINE: u64 = 0xffff_ffff_c000_8000;
    const SLOT: u64 = 0xffff_c900_0001_3f58;

    fn call(site: u64) -> Call {
        Call {
            site,
            entry_regs: X86Registers::default(),
            entry_values: Vec::new(),
        }
    }

    #[test]
    fn a_tail_call_stacks_on_its_callers_slot_and_one_return_ends_both_innermost_last() {
        let mut ledger = Ledger::new(4);

        let a = ledger.enter(SLOT, 0xffff_ffff_8134_9955, TRAMPOLINE, call(0xa));
        // A's entry swapped the slot; B, tail-called from A, finds the trampoline there.
        let b = ledger.enter(SLOT, TRAMPOLINE, TRAMPOLINE, call(0xb));
        let Return::Calls(chain) = ledger.leave(SLOT) else {
            panic!("the return found no calls");
        };

        assert_eq!(
            a,
            Entry::Swap {
                index: 0,
                stale: vec![]
            }
        );
        assert_eq!(b, Entry::Chained);
        assert_eq!(chain.original, 0xffff_ffff_8134_9955);
        let sites: Vec<u64> = chain.calls.iter().map(|c| c.site).collect();
        assert_eq!(sites, [0xa, 0xb]);
        assert_eq!((ledger.tail_calls, ledger.unaccounted), (1, 0));
        assert!(ledger.is_empty());
    }

    #[test]
    fn a_call_at_a_slot_whose_swap_is_gone_replaces_the_stale_call_and_frees_its_entry() {
        let mut ledger = Ledger::new(2);
        ledger.enter(SLOT, 0xffff_ffff_8100_0001, TRAMPOLINE, call(0xa));

        // The task exited inside A; a new call on the reused stack holds a real address.
        let again = ledger.enter(SLOT, 0xffff_ffff_8100_0002, TRAMPOLINE, call(0xb));
        let Return::Calls(chain) = ledger.leave(SLOT) else {
            panic!("the return found no calls");
        };

        assert_eq!(
            again,
            Entry::Swap {
                index: 0,
                stale: vec![0]
            }
        );
        assert_eq!(chain.original, 0xffff_ffff_8100_0002);
        assert_eq!(chain.calls.len(), 1);
    }

    #[test]
    fn a_return_through_a_slot_with_no_call_is_unaccounted_with_the_slots_last_return() {
        let mut ledger = Ledger::new(2);
        ledger.enter(SLOT, 0xffff_ffff_8100_0001, TRAMPOLINE, call(0xa));
        ledger.leave(SLOT);

        let second = ledger.leave(SLOT);
        let never = ledger.leave(SLOT + 8);

        assert!(matches!(
            second,
            Return::Unaccounted {
                fallback: Some(0xffff_ffff_8100_0001)
            }
        ));
        assert!(matches!(never, Return::Unaccounted { fallback: None }));
        assert_eq!(ledger.unaccounted, 2);
    }

    #[test]
    fn an_entry_at_a_swapped_slot_with_no_record_is_left_alone() {
        let mut ledger = Ledger::new(2);

        let entry = ledger.enter(SLOT, TRAMPOLINE, TRAMPOLINE, call(0xa));

        assert_eq!(entry, Entry::Unaccounted);
        assert!(ledger.is_empty());
    }

    #[test]
    fn a_full_journal_misses_the_call_and_a_chain_stops_at_its_limit() {
        let mut ledger = Ledger::new(1);
        ledger.enter(SLOT, 0xffff_ffff_8100_0001, TRAMPOLINE, call(0xa));

        let full = ledger.enter(SLOT + 8, 0xffff_ffff_8100_0002, TRAMPOLINE, call(0xb));
        for _ in 1..MAX_TAIL_CHAIN {
            assert_eq!(
                ledger.enter(SLOT, TRAMPOLINE, TRAMPOLINE, call(0xc)),
                Entry::Chained
            );
        }
        let deep = ledger.enter(SLOT, TRAMPOLINE, TRAMPOLINE, call(0xd));

        assert_eq!(full, Entry::Missed { stale: vec![] });
        assert_eq!(deep, Entry::Missed { stale: vec![] });
        assert_eq!(ledger.missed, 2);
        assert_eq!(ledger.len(), MAX_TAIL_CHAIN);
    }

    #[test]
    fn draining_gives_every_chain_with_its_real_return_address() {
        let mut ledger = Ledger::new(4);
        ledger.enter(SLOT, 0xffff_ffff_8100_0001, TRAMPOLINE, call(0xa));
        ledger.enter(SLOT, TRAMPOLINE, TRAMPOLINE, call(0xb));
        ledger.enter(SLOT - 0x40, 0xffff_ffff_8100_0002, TRAMPOLINE, call(0xc));

        let mut left: Vec<(u64, u64, usize)> = ledger
            .drain()
            .map(|(slot, c)| (slot, c.original, c.calls.len()))
            .collect();
        left.sort_unstable();

        assert_eq!(
            left,
            [
                (SLOT - 0x40, 0xffff_ffff_8100_0002, 1),
                (SLOT, 0xffff_ffff_8100_0001, 2)
            ]
        );
        assert!(ledger.is_empty());
    }
}
