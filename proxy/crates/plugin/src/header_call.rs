//! `host.request-header` and `host.response-header`, the calls a header
//! check makes on every request, with the name and the value moved across
//! by shortcuts.
//!
//! The bindings' versions lift the name into a `String` (an allocation, a
//! copy and a UTF-8 check) and return the value as a `Vec<u8>` (another
//! allocation and copy) that wasmtime's generic lowering then writes into
//! the guest one field at a time, looking the guest's memory up again for
//! each: ~850 instructions of the ~2,000 a call takes (callgrind, `/key`).
//! Here a short ASCII name is copied onto the stack, the value is the
//! header map's own bytes (a reference count, no copy), and the result is
//! written with one memory lookup after the guest's `cabi_realloc`. A long
//! or non-ASCII name, or a guest that does not use UTF-8 strings, takes
//! wasmtime's own lift; the result's layout is asserted against wasmtime's.

use std::mem::MaybeUninit;

use wasmtime::component::__internal::wasmtime_environ::component::StringEncoding;
use wasmtime::component::__internal::{
    CanonicalAbiInfo, InstanceType, InterfaceType, LiftContext, LowerContext,
};
use wasmtime::component::{ComponentType, Lift, Linker, LinkerInstance, Lower};

use super::state::State;

/// The interfaces both calls live in, as the bindings name them: the
/// contract's and 0.2's.
const HOSTS: [&str; 2] = [
    "portcullis:policy/host@0.3.0",
    "portcullis:policy/host@0.2.1",
];

/// Names up to this long (all the usual ones) are lifted onto the stack.
const INLINE: usize = 64;

/// Replaces the bindings' `request-header` and `response-header` in
/// `linker` (which must already hold them) with the versions here.
pub fn add_to_linker(linker: &mut Linker<State>) -> wasmtime::Result<()> {
    linker.allow_shadowing(true);
    for name in HOSTS {
        let mut host = linker.instance(name)?;
        define(&mut host, "request-header", |s| &s.request_headers)?;
        define(&mut host, "response-header", |s| &s.response_headers)?;
    }
    linker.allow_shadowing(false);
    Ok(())
}

/// Defines `call`: the first value of a header in the map `headers` picks.
fn define<F>(host: &mut LinkerInstance<'_, State>, call: &str, headers: F) -> wasmtime::Result<()>
where
    F: Fn(&State) -> &http::HeaderMap + Send + Sync + 'static,
{
    host.func_wrap(
        call,
        move |store: wasmtime::StoreContextMut<'_, State>, (name,): (Name,)| {
            Ok((Value(headers(store.data()).get(name.as_str()).cloned()),))
        },
    )
}

/// A header name a plugin asks for (a `string`).
pub enum Name {
    /// Short and ASCII, as nearly every name is.
    Inline { bytes: [u8; INLINE], len: usize },
    /// Anything else, lifted by wasmtime.
    Lifted(String),
}

impl Name {
    fn as_str(&self) -> &str {
        match self {
            Name::Inline { bytes, len } => {
                let ascii = &bytes[..*len];
                debug_assert!(ascii.is_ascii());
                // SAFETY: only ASCII is kept inline (checked at the lift),
                // and ASCII is UTF-8.
                unsafe { std::str::from_utf8_unchecked(ascii) }
            }
            Name::Lifted(s) => s,
        }
    }

    /// The name in the guest's memory at `ptr`, if short and ASCII there.
    fn inline(memory: &[u8], ptr: usize, len: usize) -> Option<Name> {
        let name = memory.get(ptr..)?.get(..len)?;
        if len > INLINE || !name.is_ascii() {
            return None;
        }
        let mut bytes = [0u8; INLINE];
        bytes[..len].copy_from_slice(name);
        Some(Name::Inline { bytes, len })
    }
}

// SAFETY: `Name` is lifted exactly as a `string` is: the same flat
// representation (pointer and length) and the same type check.
unsafe impl ComponentType for Name {
    type Lower = <String as ComponentType>::Lower;
    const ABI: CanonicalAbiInfo = <String as ComponentType>::ABI;

    fn typecheck(ty: &InterfaceType, types: &InstanceType<'_>) -> wasmtime::Result<()> {
        <String as ComponentType>::typecheck(ty, types)
    }
}

// SAFETY: reads only the guest memory the lift context lends, in bounds
// (checked by `get`), or defers to `String`'s lift.
unsafe impl Lift for Name {
    fn linear_lift_from_flat(
        cx: &mut LiftContext<'_>,
        ty: InterfaceType,
        src: &Self::Lower,
    ) -> wasmtime::Result<Self> {
        let (ptr, len) = (src[0].get_u32() as usize, src[1].get_u32() as usize);
        if cx.options().string_encoding == StringEncoding::Utf8
            && let Some(name) = Name::inline(cx.memory(), ptr, len)
        {
            // What wasmtime's lift charges a host call for the bytes it reads.
            cx.consume_fuel(len)?;
            return Ok(name);
        }
        String::linear_lift_from_flat(cx, ty, src).map(Name::Lifted)
    }

    fn linear_lift_from_memory(
        cx: &mut LiftContext<'_>,
        ty: InterfaceType,
        bytes: &[u8],
    ) -> wasmtime::Result<Self> {
        String::linear_lift_from_memory(cx, ty, bytes).map(Name::Lifted)
    }
}

/// A header's value, or none (an `option<list<u8>>`).
pub struct Value(Option<http::HeaderValue>);

impl Value {
    fn bytes(&self) -> Option<&[u8]> {
        self.0.as_ref().map(|v| v.as_bytes())
    }
}

// The canonical ABI layout (32-bit) of `option<list<u8>>`: the case byte,
// then the list's pointer and length at 4 and 8.
const SOME: u8 = 1;
const NONE: u8 = 0;
const LIST_PTR: usize = 4;
const LIST_LEN: usize = 8;
const SIZE: usize = 12;
const _: () = {
    assert!(<Option<Vec<u8>> as ComponentType>::SIZE32 == SIZE);
    assert!(<Option<Vec<u8>> as ComponentType>::ALIGN32 == 4);
};

// SAFETY: `Value` is lowered exactly as an `option<list<u8>>` is: the same
// representation, ABI and type check.
unsafe impl ComponentType for Value {
    type Lower = <Option<Vec<u8>> as ComponentType>::Lower;
    const ABI: CanonicalAbiInfo = <Option<Vec<u8>> as ComponentType>::ABI;

    fn typecheck(ty: &InterfaceType, types: &InstanceType<'_>) -> wasmtime::Result<()> {
        <Option<Vec<u8>> as ComponentType>::typecheck(ty, types)
    }
}

// SAFETY: writes only the `SIZE` bytes at `offset` (which wasmtime checked
// are in bounds and aligned) and the block the guest's realloc returned
// (which wasmtime checks is in bounds); slices are indexed, never assumed.
unsafe impl Lower for Value {
    fn linear_lower_to_flat<U>(
        &self,
        cx: &mut LowerContext<'_, U>,
        ty: InterfaceType,
        dst: &mut MaybeUninit<Self::Lower>,
    ) -> wasmtime::Result<()> {
        self.bytes().linear_lower_to_flat(cx, ty, dst)
    }

    fn linear_lower_to_memory<U>(
        &self,
        cx: &mut LowerContext<'_, U>,
        _ty: InterfaceType,
        offset: usize,
    ) -> wasmtime::Result<()> {
        let Some(value) = self.bytes() else {
            cx.get::<1>(offset)[0] = NONE;
            return Ok(());
        };
        let len = u32::try_from(value.len())?;
        let ptr = cx.realloc(0, 0, 1, value.len())?;
        let memory = cx.as_slice_mut();
        memory[ptr..ptr + value.len()].copy_from_slice(value);
        write_some(&mut memory[offset..offset + SIZE], ptr as u32, len);
        Ok(())
    }
}

/// Writes a `some` holding the list at `ptr` of `len` bytes into `at`.
fn write_some(at: &mut [u8], ptr: u32, len: u32) {
    at[0] = SOME;
    at[LIST_PTR..LIST_PTR + 4].copy_from_slice(&ptr.to_le_bytes());
    at[LIST_LEN..LIST_LEN + 4].copy_from_slice(&len.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_short_ascii_names_in_bounds_are_kept_inline() {
        let mut memory = vec![0u8; 256];
        memory[10..23].copy_from_slice(b"Authorization");
        let name = Name::inline(&memory, 10, 13).expect("inline");
        assert_eq!(name.as_str(), "Authorization");
        assert_eq!(Name::inline(&memory, 10, 0).expect("empty").as_str(), "");
        // Past the end of memory, however the sum is made.
        assert!(Name::inline(&memory, 250, 13).is_none());
        assert!(Name::inline(&memory, 300, 0).is_none());
        assert!(Name::inline(&memory, usize::MAX, 2).is_none());
        // Longer than the stack copy, or not ASCII: wasmtime's lift.
        assert!(Name::inline(&memory, 0, INLINE + 1).is_none());
        assert!(Name::inline(&memory, 0, INLINE).is_some());
        memory[12] = 0xc3;
        assert!(Name::inline(&memory, 10, 13).is_none());
    }

    #[test]
    fn a_some_is_laid_out_as_the_canonical_abi_says() {
        let mut at = [0xaa; SIZE];
        write_some(&mut at, 0x0102_0304, 7);
        assert_eq!(at[0], 1);
        assert_eq!(at[4..8], [4, 3, 2, 1]);
        assert_eq!(at[8..12], [7, 0, 0, 0]);
    }
}
