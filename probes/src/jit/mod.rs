//! JIT instrumentation (DESIGN.md, key mechanism 5): kernel functions translated block by
//! block into a code cache in the patch heap, with a counter inlined at every block
//! leader, entered through a splice at the function's entry.
//!
//! [`cache`] places the cache's parts in the heap; [`lookup`] is the in-guest table and
//! the dispatch routine that returns and indirect branches go through; [`translate`]
//! turns functions into linked translations (see its documentation for the choices:
//! original return addresses, where code leaves the cache, flags, a full cache).

pub mod cache;
pub mod lookup;
pub mod translate;

pub use cache::{CacheError, CacheLayout};
pub use lookup::{dispatch_routine, Hash, LookupError, LookupTable};
pub use translate::{
    entry_splice, stub_jump, CacheExit, CountedBlock, CounterMode, ExitReason, Link,
    TranslateError, TranslatedFunction, Translation, Translator, STUB_BYTES,
};

// In a live guest (crate::live::jit): translated from the live text, entered through
// entry splices, invalidated when the kernel changes a translated function's text, and
// detached by removing the entry splices (text byte-identical), zeroing the lookup table
// so every return and indirect branch in the cache continues at its original target, and
// checking that no vCPU RIP and no unwound return address is in the cache before the heap
// is given up. Stacks hold original return addresses only (but inside a native leaf, which
// neither calls nor sleeps), so a sleeping task never returns into the cache; an
// interrupted one may, until it runs.
