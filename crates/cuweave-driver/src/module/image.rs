//! Checks a module image's own declared extents against the slice it came in, before
//! `cuModuleLoadDataEx` (which takes only a pointer) reads it: pure code, tested without a GPU.

use std::borrow::Cow;
use std::ffi::CStr;

use crate::error::{DriverError, Result};

/// The first bytes of an ELF file.
const ELF_MAGIC: [u8; 4] = [0x7F, b'E', b'L', b'F'];
/// The first word (little-endian) of a fatbin.
const FATBIN_MAGIC: u32 = 0xBA55_ED50;
/// Bytes in an ELF64 file header.
const ELF64_HEADER: usize = 64;
/// Bytes in a fatbin header (magic, version, header size, fat size).
const FATBIN_HEADER: usize = 16;
/// Bytes of a fatbin entry's header that hold its own header size and payload size.
const FATBIN_ENTRY_HEADER: usize = 16;
/// `SHT_NOBITS`: a section that takes no bytes in the file.
const SHT_NOBITS: u32 = 8;

/// What an image turned out to be, ready to hand to the driver.
#[derive(Debug)]
pub(super) enum Image<'a> {
    /// An ELF cubin or a fatbin whose every declared extent lies inside the slice.
    Binary(&'a [u8]),
    /// PTX text, NUL-terminated inside the slice or copied into a terminated buffer.
    Ptx(Cow<'a, CStr>),
}

impl Image<'_> {
    /// The pointer for `cuModuleLoadDataEx`.
    pub(super) fn as_ptr(&self) -> *const std::ffi::c_void {
        match self {
            Self::Binary(bytes) => bytes.as_ptr().cast(),
            Self::Ptx(text) => text.as_ptr().cast(),
        }
    }
}

fn refuse(reason: impl Into<String>) -> DriverError {
    DriverError::invalid("Module::from_cubin", reason)
}

fn u16_at(bytes: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(bytes.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}

/// `offset + count * size`, checked, as a position in a slice of `len` bytes.
fn table_end(offset: u64, count: u16, size: u16) -> Option<u64> {
    offset.checked_add(u64::from(count).checked_mul(u64::from(size))?)
}

/// Sorts `image` into an ELF cubin, a fatbin or PTX text and checks that everything it declares
/// lies inside it.
///
/// # Errors
/// `InvalidArgument` for an empty image, an ELF or fatbin whose headers, tables, sections or
/// entries reach past the end of the slice (a truncated image), and for bytes that are none of
/// the three (garbage).
pub(super) fn check(image: &[u8]) -> Result<Image<'_>> {
    if image.is_empty() {
        return Err(refuse("empty image"));
    }
    if image.starts_with(&ELF_MAGIC) {
        return check_elf(image).map(|()| Image::Binary(image));
    }
    if u32_at(image, 0) == Some(FATBIN_MAGIC) {
        return check_fatbin(image).map(|()| Image::Binary(image));
    }
    check_ptx(image).map(Image::Ptx)
}

fn check_elf(image: &[u8]) -> Result<()> {
    let len = image.len() as u64;
    if image.len() < ELF64_HEADER {
        return Err(refuse(format!(
            "ELF image of {len} bytes is shorter than its {ELF64_HEADER}-byte header"
        )));
    }
    // e_ident[EI_CLASS] = ELFCLASS64, e_ident[EI_DATA] = ELFDATA2LSB: what every cubin is.
    if image[4] != 2 || image[5] != 1 {
        return Err(refuse(
            "not a 64-bit little-endian ELF image (a cubin is both)",
        ));
    }
    let field = |at| u64_at(image, at).unwrap_or(u64::MAX);
    let half = |at| u16_at(image, at).unwrap_or(u16::MAX);
    let (phoff, shoff) = (field(0x20), field(0x28));
    let (phentsize, phnum) = (half(0x36), half(0x38));
    let (shentsize, shnum) = (half(0x3A), half(0x3C));
    let past = |what: &str, end: Option<u64>| -> Result<()> {
        match end {
            Some(end) if end <= len => Ok(()),
            _ => Err(refuse(format!(
                "truncated ELF image: its {what} reaches past the {len} bytes given"
            ))),
        }
    };
    past("section header table", table_end(shoff, shnum, shentsize))?;
    past("program header table", table_end(phoff, phnum, phentsize))?;
    if shnum > 0 && usize::from(shentsize) < 0x28 {
        return Err(refuse(format!("ELF section headers of {shentsize} bytes")));
    }
    if phnum > 0 && usize::from(phentsize) < 0x28 {
        return Err(refuse(format!("ELF program headers of {phentsize} bytes")));
    }
    for index in 0..u64::from(shnum) {
        // In bounds: the whole table was checked above.
        let header = (shoff + index * u64::from(shentsize)) as usize;
        if u32_at(image, header + 4) == Some(SHT_NOBITS) {
            continue;
        }
        let (offset, size) = (field(header + 0x18), field(header + 0x20));
        past(&format!("section {index}"), offset.checked_add(size))?;
    }
    for index in 0..u64::from(phnum) {
        let header = (phoff + index * u64::from(phentsize)) as usize;
        let (offset, size) = (field(header + 0x08), field(header + 0x20));
        past(&format!("segment {index}"), offset.checked_add(size))?;
    }
    Ok(())
}

fn check_fatbin(image: &[u8]) -> Result<()> {
    let len = image.len() as u64;
    let truncated = |what: &str| {
        refuse(format!(
            "truncated fatbin: its {what} reaches past the {len} bytes given"
        ))
    };
    if image.len() < FATBIN_HEADER {
        return Err(truncated("header"));
    }
    let header_size = u64::from(u16_at(image, 6).unwrap_or(u16::MAX));
    let fat_size = u64_at(image, 8).unwrap_or(u64::MAX);
    let end = header_size
        .checked_add(fat_size)
        .filter(|&end| end <= len && header_size >= FATBIN_HEADER as u64)
        .ok_or_else(|| truncated("declared size (header size + fat size)"))?;
    // Walk the entries: each declares its own header size and payload size, and all of them
    // must stay inside the fat region.
    let mut at = header_size;
    while at < end {
        if at + FATBIN_ENTRY_HEADER as u64 > end {
            return Err(truncated("entry header"));
        }
        let entry = at as usize;
        let entry_header = u64::from(u32_at(image, entry + 4).unwrap_or(u32::MAX));
        let payload = u64_at(image, entry + 8).unwrap_or(u64::MAX);
        if entry_header < FATBIN_ENTRY_HEADER as u64 {
            return Err(refuse(format!(
                "fatbin entry at byte {at} declares a {entry_header}-byte header"
            )));
        }
        at = at
            .checked_add(entry_header)
            .and_then(|next| next.checked_add(payload))
            .filter(|&next| next <= end)
            .ok_or_else(|| truncated("entry"))?;
    }
    Ok(())
}

fn check_ptx(image: &[u8]) -> Result<Cow<'_, CStr>> {
    let text = match image.iter().position(|&byte| byte == 0) {
        // The driver stops at the first NUL, which lies inside the slice.
        Some(nul) => Cow::Borrowed(
            CStr::from_bytes_with_nul(&image[..=nul]).map_err(|e| refuse(e.to_string()))?,
        ),
        // No NUL: a terminated copy, so the driver cannot read past the slice.
        None => Cow::Owned(std::ffi::CString::new(image).map_err(|e| refuse(e.to_string()))?),
    };
    let is_ptx = std::str::from_utf8(text.to_bytes()).is_ok_and(|text| text.contains(".version"));
    if !is_ptx {
        return Err(refuse(
            "not an ELF cubin, a fatbin (magic 0xBA55ED50) or PTX text (with `.version`)",
        ));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal well-formed ELF64 image: header, one section of `payload` bytes, and its
    /// section header table.
    fn elf(payload: usize) -> Vec<u8> {
        let mut image = vec![0u8; ELF64_HEADER];
        image[..4].copy_from_slice(&ELF_MAGIC);
        image[4] = 2;
        image[5] = 1;
        let section = image.len() as u64;
        image.resize(image.len() + payload, 0xAB);
        let shoff = image.len() as u64;
        image[0x28..0x30].copy_from_slice(&shoff.to_le_bytes());
        image[0x3A..0x3C].copy_from_slice(&64u16.to_le_bytes());
        image[0x3C..0x3E].copy_from_slice(&2u16.to_le_bytes());
        // Section 0: the null section. Section 1: `payload` bytes at `section`.
        image.resize(image.len() + 64, 0);
        let mut header = vec![0u8; 64];
        header[4..8].copy_from_slice(&1u32.to_le_bytes());
        header[0x18..0x20].copy_from_slice(&section.to_le_bytes());
        header[0x20..0x28].copy_from_slice(&(payload as u64).to_le_bytes());
        image.extend_from_slice(&header);
        image
    }

    /// A minimal fatbin: header and one entry with `payload` bytes.
    fn fatbin(payload: usize) -> Vec<u8> {
        let fat_size = (FATBIN_ENTRY_HEADER + payload) as u64;
        let mut image = Vec::new();
        image.extend_from_slice(&FATBIN_MAGIC.to_le_bytes());
        image.extend_from_slice(&1u16.to_le_bytes());
        image.extend_from_slice(&(FATBIN_HEADER as u16).to_le_bytes());
        image.extend_from_slice(&fat_size.to_le_bytes());
        image.extend_from_slice(&2u16.to_le_bytes());
        image.extend_from_slice(&0x101u16.to_le_bytes());
        image.extend_from_slice(&(FATBIN_ENTRY_HEADER as u32).to_le_bytes());
        image.extend_from_slice(&(payload as u64).to_le_bytes());
        image.resize(image.len() + payload, 0xCD);
        image
    }

    fn refused(image: &[u8]) -> bool {
        matches!(
            check(image),
            Err(DriverError::InvalidArgument {
                operation: "Module::from_cubin",
                ..
            })
        )
    }

    #[test]
    fn whole_images_pass() {
        assert!(matches!(check(&elf(100)), Ok(Image::Binary(_))));
        assert!(matches!(check(&fatbin(100)), Ok(Image::Binary(_))));
        assert!(matches!(
            check(b".version 8.0\n.target sm_90\0"),
            Ok(Image::Ptx(Cow::Borrowed(_)))
        ));
        // PTX without a NUL is copied into a terminated buffer.
        assert!(matches!(
            check(b".version 8.0\n.target sm_90"),
            Ok(Image::Ptx(Cow::Owned(_)))
        ));
    }

    /// A cubin and a fatbin that nvcc built (`tests/images/README.md`).
    const CUBIN: &[u8] = include_bytes!("../../tests/images/fill_sm90.cubin");
    const FATBIN: &[u8] = include_bytes!("../../tests/images/fill_sm90.fatbin");

    #[test]
    fn images_nvcc_built_pass() {
        assert!(matches!(check(CUBIN), Ok(Image::Binary(_))));
        assert!(matches!(check(FATBIN), Ok(Image::Binary(_))));
    }

    #[test]
    fn every_truncation_of_an_elf_or_fatbin_is_refused() {
        for whole in [elf(100), fatbin(100), CUBIN.to_vec(), FATBIN.to_vec()] {
            for len in 1..whole.len() {
                assert!(refused(&whole[..len]), "{len} of {} bytes", whole.len());
            }
        }
    }

    #[test]
    fn sections_and_entries_past_the_end_are_refused() {
        let mut image = elf(100);
        let header = image.len() - 64;
        image[header + 0x20..header + 0x28].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(refused(&image));
        let mut image = fatbin(100);
        image[24..32].copy_from_slice(&101u64.to_le_bytes());
        assert!(refused(&image));
        let mut image = fatbin(100);
        image[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(refused(&image));
        let mut image = elf(10);
        image[0x3C..0x3E].copy_from_slice(&u16::MAX.to_le_bytes());
        assert!(refused(&image));
    }

    #[test]
    fn garbage_is_refused() {
        assert!(refused(b""));
        assert!(refused(&[0xFF; 4096]));
        assert!(refused(b"hello, world"));
        assert!(refused(b"\x7fELF"));
        let mut thirty_two_bit = elf(10);
        thirty_two_bit[4] = 1;
        assert!(refused(&thirty_two_bit));
        // Deterministic pseudo-random bytes never pass unless they happen to be a valid image.
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for len in [1, 7, 16, 64, 1000] {
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state as u8
                })
                .collect();
            assert!(refused(&bytes));
        }
    }
}
