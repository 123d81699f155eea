//! A plugin's `decision`, lifted from its memory with a shortcut for the
//! answer nearly every call gives: `forward` with no header edits, no new
//! path and no other upstream.
//!
//! wasmtime's derived lift of that answer walks the variant, the `forward`
//! record, its `header-edits` record with three lists and two options, with
//! a type-table lookup and a bounds check at each step: ~640 instructions a
//! call (callgrind, `/key`), more than the guest's own code takes for a
//! header check. The shortcut reads the six words that say "nothing to
//! change" and checks what the full lift would check of them (the empty
//! lists' pointers aligned and inside memory). Any other answer, or one
//! that fails those checks, takes the full lift, which also makes the
//! error for a malformed one. Both contracts' `decision` (0.3, and 0.2
//! without `callout`) lay `forward` out alike, and `forward` is their
//! largest case, so their sizes are the same too.

use wasmtime::component::__internal::{CanonicalAbiInfo, InstanceType, InterfaceType, LiftContext};
use wasmtime::component::{ComponentType, Lift};

use super::bindings::{self, v0_2};

/// A `decision` of either contract, and its `forward` with nothing in it.
pub trait DecisionType: ComponentType + Lift {
    fn unchanged() -> Self;
}

impl DecisionType for bindings::Decision {
    fn unchanged() -> Self {
        bindings::Decision::Forward(bindings::Forward {
            headers: bindings::HeaderEdits {
                remove: Vec::new(),
                set: Vec::new(),
                add: Vec::new(),
            },
            path: None,
            upstream: None,
        })
    }
}

impl DecisionType for v0_2::Decision {
    fn unchanged() -> Self {
        v0_2::Decision::Forward(v0_2::portcullis::policy::types::Forward {
            headers: v0_2::HeaderEdits {
                remove: Vec::new(),
                set: Vec::new(),
                add: Vec::new(),
            },
            path: None,
            upstream: None,
        })
    }
}

/// A lifted `decision`.
pub struct Lifted<D>(pub D);

// The canonical ABI layout (32-bit) the shortcut reads: the variant's case
// in byte 0 and its payload at 4; `forward` is `header-edits` (three lists
// of pointer and length), then `path` and `upstream` (each an option's case
// byte and a string).
const FORWARD_CASE: u8 = 0;
const LIST_LENS: [usize; 3] = [8, 16, 24];
const LIST_PTRS: [usize; 3] = [4, 12, 20];
const PATH_CASE: usize = 28;
const UPSTREAM_CASE: usize = 40;
/// Lists of strings and of headers are both 4-aligned.
const LIST_ALIGN: u32 = 4;
// The layout above, checked against wasmtime's own at compile time.
const _: () = {
    use v0_2::portcullis::policy::types as old;
    assert!(<v0_2::Decision as ComponentType>::SIZE32 == SIZE);
    assert!(<bindings::Decision as ComponentType>::SIZE32 == SIZE);
    assert!(<old::Forward as ComponentType>::SIZE32 == 48);
    assert!(<old::HeaderEdits as ComponentType>::SIZE32 == 24);
    assert!(<v0_2::Decision as ComponentType>::ALIGN32 == 4);
    assert!(<bindings::Forward as ComponentType>::SIZE32 == 48);
    assert!(<bindings::HeaderEdits as ComponentType>::SIZE32 == 24);
    assert!(<bindings::Decision as ComponentType>::ALIGN32 == 4);
};
/// The size of a `decision`.
const SIZE: usize = 52;

fn word(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("four bytes"))
}

/// Whether `bytes` (a `decision` of `size` bytes) is `forward` with nothing
/// in it, as the full lift would accept it.
fn forward_unchanged(bytes: &[u8], size: usize, memory_len: usize) -> bool {
    let pointer_ok = |at: usize| {
        let ptr = word(bytes, at);
        ptr.is_multiple_of(LIST_ALIGN) && ptr as usize <= memory_len
    };
    // Written out rather than looped: this runs on every call.
    bytes.len() == size
        && bytes.len() > UPSTREAM_CASE
        && bytes[0] == FORWARD_CASE
        && bytes[PATH_CASE] == 0
        && bytes[UPSTREAM_CASE] == 0
        && (word(bytes, LIST_LENS[0]) | word(bytes, LIST_LENS[1]) | word(bytes, LIST_LENS[2])) == 0
        && pointer_ok(LIST_PTRS[0])
        && pointer_ok(LIST_PTRS[1])
        && pointer_ok(LIST_PTRS[2])
}

// SAFETY: `Lifted<D>` is `D` under another name: the same lowered
// representation, ABI and type check, so wasmtime's guarantees for `D`
// hold for it.
unsafe impl<D: DecisionType> ComponentType for Lifted<D> {
    type Lower = D::Lower;
    const ABI: CanonicalAbiInfo = D::ABI;

    fn typecheck(ty: &InterfaceType, types: &InstanceType<'_>) -> wasmtime::Result<()> {
        D::typecheck(ty, types)
    }
}

// SAFETY: as above; every lift either reads only `bytes` or is `D`'s.
unsafe impl<D: DecisionType> Lift for Lifted<D> {
    fn linear_lift_from_flat(
        cx: &mut LiftContext<'_>,
        ty: InterfaceType,
        src: &Self::Lower,
    ) -> wasmtime::Result<Self> {
        D::linear_lift_from_flat(cx, ty, src).map(Lifted)
    }

    fn linear_lift_from_memory(
        cx: &mut LiftContext<'_>,
        ty: InterfaceType,
        bytes: &[u8],
    ) -> wasmtime::Result<Self> {
        if forward_unchanged(bytes, D::SIZE32, cx.memory().len()) {
            return Ok(Lifted(D::unchanged()));
        }
        D::linear_lift_from_memory(cx, ty, bytes).map(Lifted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `forward` with nothing in it, as a guest lays it out: empty
    /// lists with dangling (aligned) pointers.
    fn empty_forward(size: usize) -> Vec<u8> {
        let mut bytes = vec![0u8; size];
        for at in LIST_PTRS {
            bytes[at..at + 4].copy_from_slice(&4u32.to_le_bytes());
        }
        bytes
    }

    #[test]
    fn only_an_empty_forward_takes_the_shortcut() {
        let memory = 1 << 16;
        for size in [
            <v0_2::Decision as ComponentType>::SIZE32,
            <bindings::Decision as ComponentType>::SIZE32,
        ] {
            let unchanged = |b: &[u8]| forward_unchanged(b, size, memory);
            assert!(unchanged(&empty_forward(size)));
            // Any content, another case, or what the full lift would
            // refuse, goes the long way.
            for at in LIST_LENS {
                let mut b = empty_forward(size);
                b[at] = 1;
                assert!(!unchanged(&b), "list length at {at}");
            }
            for at in [0, PATH_CASE, UPSTREAM_CASE] {
                let mut b = empty_forward(size);
                b[at] = 1;
                assert!(!unchanged(&b), "case byte at {at}");
            }
            for at in LIST_PTRS {
                let mut b = empty_forward(size);
                b[at] = 5;
                assert!(!unchanged(&b), "misaligned pointer at {at}");
                b[at..at + 4].copy_from_slice(&(memory as u32 + 4).to_le_bytes());
                assert!(!unchanged(&b), "pointer past memory at {at}");
            }
            assert!(!unchanged(&empty_forward(size)[..48]));
        }
    }
}
