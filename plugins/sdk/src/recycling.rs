//! The allocator plugins built with the SDK use (feature `recycling-alloc`,
//! on by default): small blocks are kept on a free list per size class in
//! front of the C library's allocator (dlmalloc, in wasm32-wasip2).
//!
//! Nearly every call allocates a little and frees it again: the header
//! value the host writes into the plugin through `cabi_realloc`, the
//! plugin's own strings. dlmalloc's `malloc` and `free` took ~300 of the
//! ~800 instructions of a header check's guest code per call (callgrind on
//! the compiled plugin); a free-list pop and push take a few. Blocks of up
//! to 1 KiB are rounded up to a power of two and, once freed, kept for the
//! next block of their class instead of going back to dlmalloc: a plugin
//! holds at most its peak use of small blocks, inside its memory cap.
//!
//! Single-threaded: a plugin instance runs one call at a time on one
//! thread, and wasm32-wasip2 has no threads; the global is only installed
//! where the target has no atomics (no shared memory).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::UnsafeCell;
use std::ptr;

/// Size classes: 16, 32, ..., 1024 bytes.
const CLASSES: usize = 7;
const MIN_SHIFT: u32 = 4;
const MAX_SMALL: usize = 1 << (MIN_SHIFT as usize + CLASSES - 1);
/// Blocks are taken from the C allocator with its natural alignment, so
/// only layouts that need no more than that are recycled.
const BLOCK_ALIGN: usize = 8;

/// Free lists in front of [`System`]: each free block's first word points
/// to the next free block of its class.
pub struct Recycling {
    free: UnsafeCell<[*mut u8; CLASSES]>,
}

// SAFETY: only installed where there is one thread (see the module docs);
// the tests use their own instance on one thread.
unsafe impl Sync for Recycling {}

impl Recycling {
    /// No free blocks yet.
    pub const fn new() -> Recycling {
        Recycling {
            free: UnsafeCell::new([ptr::null_mut(); CLASSES]),
        }
    }
}

impl Default for Recycling {
    fn default() -> Self {
        Recycling::new()
    }
}

/// The class a layout is served from, if it is small.
fn class(layout: Layout) -> Option<usize> {
    if layout.size() > MAX_SMALL || layout.align() > BLOCK_ALIGN {
        return None;
    }
    let size = layout.size().max(1 << MIN_SHIFT);
    Some((usize::BITS - (size - 1).leading_zeros() - MIN_SHIFT) as usize)
}

fn block(class: usize) -> Layout {
    // Cannot fail: at most MAX_SMALL bytes, a power-of-two alignment.
    Layout::from_size_align(1 << (MIN_SHIFT as usize + class), BLOCK_ALIGN).expect("block layout")
}

// SAFETY: every block handed out is either a whole block of its class from
// `System` (at least the layout's size, aligned to BLOCK_ALIGN, which is at
// least the layout's alignment) or `System`'s own answer for the layout;
// `dealloc` and `realloc` get the layout the block was made for (the
// `GlobalAlloc` contract), so they find the same class.
unsafe impl GlobalAlloc for Recycling {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some(c) = class(layout) else {
            // SAFETY: the caller's layout, as given.
            return unsafe { System.alloc(layout) };
        };
        // SAFETY: one thread; the lists hold only free blocks of class `c`,
        // each of whose first word was written by `dealloc`.
        unsafe {
            let free = &mut *self.free.get();
            let head = free[c];
            if head.is_null() {
                return System.alloc(block(c));
            }
            free[c] = head.cast::<*mut u8>().read();
            head
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let Some(c) = class(layout) else {
            // SAFETY: a block `System` made for this layout.
            return unsafe { System.dealloc(ptr, layout) };
        };
        // SAFETY: one thread; `ptr` is a free block of class `c`, at least
        // 16 bytes and 8-aligned, so its first word can hold the link.
        unsafe {
            let free = &mut *self.free.get();
            ptr.cast::<*mut u8>().write(free[c]);
            free[c] = ptr;
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if class(layout).is_none() {
            // SAFETY: the caller's layout, as given.
            return unsafe { System.alloc_zeroed(layout) };
        }
        // SAFETY: a recycled block holds old bytes; clear what is asked for.
        unsafe {
            let p = self.alloc(layout);
            if !p.is_null() {
                p.write_bytes(0, layout.size());
            }
            p
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller guarantees a valid size for this alignment.
        let new = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        match (class(layout), class(new)) {
            // SAFETY: a block `System` made for `layout`.
            (None, None) => unsafe { System.realloc(ptr, layout, new_size) },
            // The block is already big enough.
            (Some(a), Some(b)) if a == b => ptr,
            // SAFETY: a new block, the old contents moved, the old freed.
            _ => unsafe {
                let p = self.alloc(new);
                if !p.is_null() {
                    ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size));
                    self.dealloc(ptr, layout);
                }
                p
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(size: usize, align: usize) -> Layout {
        Layout::from_size_align(size, align).unwrap()
    }

    #[test]
    fn sizes_fall_in_the_right_class() {
        assert_eq!(class(layout(0, 1)), Some(0));
        assert_eq!(class(layout(16, 8)), Some(0));
        assert_eq!(class(layout(17, 1)), Some(1));
        assert_eq!(class(layout(150, 1)), Some(4));
        assert_eq!(class(layout(1024, 4)), Some(6));
        assert_eq!(class(layout(1025, 1)), None);
        assert_eq!(class(layout(32, 16)), None);
        for size in 1..=MAX_SMALL {
            let c = class(layout(size, 1)).unwrap();
            assert!(block(c).size() >= size, "{size} in class {c}");
            assert!(c == 0 || block(c - 1).size() < size, "{size} in class {c}");
        }
    }

    #[test]
    fn a_freed_block_is_handed_out_again_for_its_class_only() {
        let a = Recycling::new();
        unsafe {
            let p = a.alloc(layout(100, 1));
            p.write_bytes(0xab, 100);
            a.dealloc(p, layout(100, 1));
            // Another class does not get it; its own class does.
            let q = a.alloc(layout(200, 1));
            assert_ne!(p, q);
            let r = a.alloc(layout(65, 4));
            assert_eq!(p, r);
            // Zeroed means zeroed, even recycled.
            a.dealloc(r, layout(65, 4));
            let z = a.alloc_zeroed(layout(128, 1));
            assert_eq!(z, p);
            assert!(std::slice::from_raw_parts(z, 128).iter().all(|b| *b == 0));
            a.dealloc(z, layout(128, 1));
            a.dealloc(q, layout(200, 1));
        }
    }

    #[test]
    fn realloc_keeps_the_bytes_across_classes_and_to_the_system() {
        let a = Recycling::new();
        unsafe {
            let mut p = a.alloc(layout(10, 1));
            let mut len = 10;
            for (i, b) in std::slice::from_raw_parts_mut(p, len)
                .iter_mut()
                .enumerate()
            {
                *b = i as u8;
            }
            // Within the class, across classes, past the small sizes, back.
            for new in [16, 17, 500, 1024, 5000, 70_000, 300, 12] {
                p = a.realloc(p, layout(len, 1), new);
                assert!(!p.is_null());
                let kept = len.min(new);
                let bytes = std::slice::from_raw_parts(p, kept);
                assert!(
                    bytes.iter().enumerate().all(|(i, b)| *b == i as u8),
                    "{len} -> {new}"
                );
                for (i, b) in std::slice::from_raw_parts_mut(p, new)
                    .iter_mut()
                    .enumerate()
                {
                    *b = i as u8;
                }
                len = new;
            }
            a.dealloc(p, layout(len, 1));
        }
    }

    #[test]
    fn random_allocations_never_overlap_or_lose_bytes() {
        // Live blocks, each filled with its own byte; after every step all
        // of them must still hold it (an overlap or a bad copy would not).
        let a = Recycling::new();
        let mut live: Vec<(*mut u8, Layout, u8)> = Vec::new();
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        let sizes = [
            0, 1, 7, 15, 16, 17, 31, 33, 100, 255, 512, 1000, 1024, 1025, 4096,
        ];
        unsafe {
            for step in 0..5_000u32 {
                let fill = step as u8;
                match next(3) {
                    0 if !live.is_empty() => {
                        let (p, l, _) = live.swap_remove(next(live.len()));
                        a.dealloc(p, l);
                    }
                    1 if !live.is_empty() => {
                        let i = next(live.len());
                        let (p, l, old) = live[i];
                        let size = sizes[next(sizes.len())];
                        let q = a.realloc(p, l, size);
                        let kept = l.size().min(size);
                        assert!(
                            std::slice::from_raw_parts(q, kept)
                                .iter()
                                .all(|b| *b == old)
                        );
                        q.write_bytes(fill, size);
                        live[i] = (q, layout(size, l.align()), fill);
                    }
                    _ => {
                        let l = layout(sizes[next(sizes.len())], [1, 4, 8, 16][next(4)]);
                        let p = a.alloc(l);
                        assert!(!p.is_null() && (p as usize).is_multiple_of(l.align()));
                        p.write_bytes(fill, l.size());
                        live.push((p, l, fill));
                    }
                }
                for (p, l, b) in &live {
                    let bytes = std::slice::from_raw_parts(*p, l.size());
                    assert!(bytes.iter().all(|x| x == b), "step {step}");
                }
            }
            for (p, l, _) in live {
                a.dealloc(p, l);
            }
        }
    }

    #[test]
    fn many_blocks_are_distinct_and_come_back() {
        let a = Recycling::new();
        unsafe {
            let blocks: Vec<*mut u8> = (0..100).map(|_| a.alloc(layout(48, 8))).collect();
            let mut sorted = blocks.clone();
            sorted.sort();
            sorted.dedup();
            assert_eq!(sorted.len(), 100);
            assert!(blocks.iter().all(|p| (*p as usize).is_multiple_of(8)));
            for p in &blocks {
                a.dealloc(*p, layout(48, 8));
            }
            // All recycled: the next hundred are the same blocks.
            let mut again: Vec<*mut u8> = (0..100).map(|_| a.alloc(layout(40, 8))).collect();
            again.sort();
            assert_eq!(again, sorted);
            for p in again {
                a.dealloc(p, layout(40, 8));
            }
        }
    }
}
