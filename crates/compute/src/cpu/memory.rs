//! Memory for weights.

use std::marker::PhantomData;

/// Element types [`WeightMemory`] holds: plain numbers, valid for any bits (zeroed memory
/// included).
pub trait WeightElem: Copy + Send + Sync + 'static + private::Sealed {}
impl WeightElem for f32 {}
impl WeightElem for u8 {}
mod private {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for u8 {}
}

/// A model's weights in their own anonymous mapping, asked of Linux as transparent huge pages
/// before anything is written: a decode step streams every weight, and with 2 MiB pages it
/// misses the TLB 512 times less than with 4 KiB ones (measured: the 538 MB of a 135M-parameter
/// f32 model stream ~4% faster on 2 cores). Where the mapping or the advice is refused it is
/// ordinary memory. Reads as a slice.
pub struct WeightMemory<T: WeightElem> {
    /// `None` when empty.
    map: Option<memmap2::MmapMut>,
    /// Where the elements start in the mapping (its first 2 MiB boundary).
    offset: usize,
    len: usize,
    _elem: PhantomData<T>,
}

const HUGE_PAGE: usize = 2 << 20;

impl<T: WeightElem> WeightMemory<T> {
    /// `len` elements, written by `fill` (which gets them zeroed).
    ///
    /// # Panics
    /// If the system refuses the mapping (out of memory), as a `Vec` would abort.
    pub fn filled(len: usize, fill: impl FnOnce(&mut [T])) -> Self {
        let bytes = len * std::mem::size_of::<T>();
        if bytes == 0 {
            return Self { map: None, offset: 0, len, _elem: PhantomData };
        }
        // Below one huge page the advice would back a few kilobytes with 2 MiB; above it, one
        // huge page more than needed, so that the elements can start on a 2 MiB boundary.
        let huge = bytes >= HUGE_PAGE;
        let mut map = memmap2::MmapMut::map_anon(bytes + if huge { HUGE_PAGE } else { 0 })
            .unwrap_or_else(|e| panic!("mapping {bytes} bytes of weight memory: {e}"));
        #[cfg(target_os = "linux")]
        if huge {
            // Advice only: refused, the memory is ordinary pages.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        let offset = if huge { map.as_ptr().align_offset(HUGE_PAGE).min(HUGE_PAGE) } else { 0 };
        let mut memory = Self { map: None, offset, len, _elem: PhantomData };
        // Safety: the mapping holds `offset + bytes` bytes (at most one huge page more); it is
        // page-aligned and `offset` a multiple of every element's alignment (1 or 4), so the
        // elements are aligned; zeroed bytes are valid elements (`WeightElem`); `map` is
        // borrowed mutably for the slice's life.
        fill(unsafe { std::slice::from_raw_parts_mut(map.as_mut_ptr().add(offset).cast::<T>(), len) });
        memory.map = Some(map);
        memory
    }

    /// A copy of the slices `parts`, one after another.
    pub fn concat(parts: &[&[T]]) -> Self {
        let len = parts.iter().map(|p| p.len()).sum();
        Self::filled(len, |out| {
            let mut at = 0;
            for p in parts {
                out[at..at + p.len()].copy_from_slice(p);
                at += p.len();
            }
        })
    }
}

impl<T: WeightElem> std::ops::Deref for WeightMemory<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.map {
            // Safety: as in `filled`: in bounds, aligned, initialized; borrowed from `self`.
            Some(map) => unsafe { std::slice::from_raw_parts(map.as_ptr().add(self.offset).cast::<T>(), self.len) },
            None => &[],
        }
    }
}

impl<T: WeightElem> Clone for WeightMemory<T> {
    fn clone(&self) -> Self {
        Self::concat(&[self])
    }
}

impl<T: WeightElem + std::fmt::Debug> std::fmt::Debug for WeightMemory<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WeightMemory({} x {})", self.len, std::any::type_name::<T>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_memory_holds_what_it_was_given() {
        let a: Vec<f32> = (0..(3 << 20)).map(|i| i as f32).collect();
        let m = WeightMemory::concat(&[&a[..10], &a[10..]]);
        assert_eq!(&m[..], &a[..]);
        assert_eq!(m.as_ptr() as usize % HUGE_PAGE, 0, "starts on a huge page");
        let b = WeightMemory::<u8>::filled(5, |s| s.copy_from_slice(b"abcde"));
        assert_eq!(&b.clone()[..], b"abcde");
        assert!(WeightMemory::<f32>::concat(&[]).is_empty());
    }
}
