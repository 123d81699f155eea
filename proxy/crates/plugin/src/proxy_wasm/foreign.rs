//! `proxy_call_foreign_function`: the functions Envoy offers by name that
//! make sense outside Envoy, `compress` and `uncompress` (zlib's format,
//! as Envoy's calls zlib's `compress` and `uncompress`); any other name is
//! `NotFound`, as Envoy answers for a name it lacks (Higress's wasm-go
//! asks for `get_log_level` on every log line and carries on; Envoy's
//! CEL, filter-state and property-declaring functions are its own).

use std::io::{Read, Write};

use flate2::Compression;
use flate2::read::ZlibDecoder;
use flate2::write::ZlibEncoder;
use wasmtime::Linker;

use super::VmState;
use super::abi::{C, R, ok};
use super::guest::{Status, give, read};

/// The most `uncompress` gives back: more fails it, where Envoy's would
/// grow its buffer without end (a small input can inflate to gigabytes).
const MAX_UNCOMPRESSED: u64 = 16 << 20;

/// Adds `proxy_call_foreign_function` to `linker`.
pub fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        "env",
        "proxy_call_foreign_function",
        |mut c: C<'_>,
         name_ptr: i32,
         name_len: i32,
         args_ptr: i32,
         args_len: i32,
         ret_ptr: i32,
         ret_len: i32|
         -> R {
            let name = read(&mut c, name_ptr, name_len)?;
            let run: fn(&[u8]) -> Option<Vec<u8>> = match &name[..] {
                b"compress" => compress,
                b"uncompress" => uncompress,
                _ => return ok(Status::NotFound),
            };
            let args = read(&mut c, args_ptr, args_len)?;
            match run(&args) {
                Some(out) if out.is_empty() => ok(Status::Ok),
                Some(out) => give(&mut c, &out, (ret_ptr, ret_len)),
                // Envoy's answer when zlib fails.
                None => ok(Status::SerializationFailure),
            }
        },
    )?;
    Ok(())
}

/// `data` in zlib's format at its default level, as zlib's `compress`.
fn compress(data: &[u8]) -> Option<Vec<u8>> {
    let mut encoder = ZlibEncoder::new(Vec::new(), Compression::default());
    encoder.write_all(data).ok()?;
    encoder.finish().ok()
}

/// A zlib stream inflated, as zlib's `uncompress`; `None` for one that is
/// not whole or inflates past [`MAX_UNCOMPRESSED`].
fn uncompress(data: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    let mut decoder = ZlibDecoder::new(data).take(MAX_UNCOMPRESSED + 1);
    decoder.read_to_end(&mut out).ok()?;
    // Nothing left over: a truncated stream is an error in zlib's too.
    let whole = decoder.into_inner().total_in() == data.len() as u64;
    (whole && out.len() as u64 <= MAX_UNCOMPRESSED).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_compressed_uncompresses_and_bombs_do_not() {
        let text = b"hello hello hello hello".repeat(10);
        let packed = compress(&text).unwrap();
        assert!(packed.len() < text.len());
        // zlib's header (deflate, default window and level).
        assert_eq!(&packed[..2], &[0x78, 0x9c]);
        assert_eq!(uncompress(&packed).unwrap(), text);
        assert_eq!(uncompress(&packed[..packed.len() - 3]), None);
        assert_eq!(uncompress(b"not zlib"), None);
        let bomb = compress(&vec![0u8; (MAX_UNCOMPRESSED + 1) as usize]).unwrap();
        assert_eq!(uncompress(&bomb), None);
    }
}
