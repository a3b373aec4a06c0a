//! [`UniqueId`]: the token that lets ranks in different processes (or hosts) find each other.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{CollectiveError, Result};
use crate::loader;
use crate::raw;

/// Bytes in an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
pub const UNIQUE_ID_BYTES: usize = 128;

/// An `ncclUniqueId`: made once, by one rank ([`UniqueId::new`]), and handed to every rank of
/// the communicator (over a file, TCP, MPI, an environment variable, …) before
/// [`Communicator::init_rank`](crate::Communicator::init_rank).
///
/// It serialises (serde) as a 256-character hex string, and converts to and from bytes and hex.
/// It holds the creating host's bootstrap address: treat it as an address, not a secret.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UniqueId([u8; UNIQUE_ID_BYTES]);

impl UniqueId {
    /// A fresh id from `ncclGetUniqueId` (it starts the bootstrap listener in this process).
    ///
    /// # Errors
    /// `NotFound` without NCCL; NCCL's error (e.g. no usable network interface).
    pub fn new() -> Result<Self> {
        Ok(Self(raw::unique_id(loader::api()?)?))
    }

    /// The id from its raw bytes.
    pub fn from_bytes(bytes: [u8; UNIQUE_ID_BYTES]) -> Self {
        Self(bytes)
    }

    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8; UNIQUE_ID_BYTES] {
        &self.0
    }

    /// Lower-case hex, 256 characters.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|byte| format!("{byte:02x}")).collect()
    }

    /// Parses [`to_hex`](Self::to_hex)'s output (surrounding whitespace ignored).
    ///
    /// # Errors
    /// `InvalidArgument` unless it is exactly 256 hex digits.
    pub fn from_hex(text: &str) -> Result<Self> {
        let text = text.trim();
        let bad = |reason: &str| CollectiveError::invalid("UniqueId::from_hex", reason);
        if text.len() != 2 * UNIQUE_ID_BYTES {
            return Err(bad(&format!(
                "expected {} hex digits, got {}",
                2 * UNIQUE_ID_BYTES,
                text.len()
            )));
        }
        let mut bytes = [0u8; UNIQUE_ID_BYTES];
        for (i, byte) in bytes.iter_mut().enumerate() {
            let pair = text.get(2 * i..2 * i + 2).ok_or_else(|| bad("not ASCII"))?;
            // `from_str_radix` alone would take a leading `+` ("+f").
            if !pair.bytes().all(|digit| digit.is_ascii_hexdigit()) {
                return Err(bad("not a hex digit"));
            }
            *byte = u8::from_str_radix(pair, 16).map_err(|_| bad("not a hex digit"))?;
        }
        Ok(Self(bytes))
    }
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId({}…)", &self.to_hex()[..16])
    }
}

impl Serialize for UniqueId {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for UniqueId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Self::from_hex(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_and_serde_round_trip() {
        let mut bytes = [0u8; UNIQUE_ID_BYTES];
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = (i * 37 % 256) as u8;
        }
        let id = UniqueId::from_bytes(bytes);
        assert_eq!(UniqueId::from_hex(&id.to_hex()).expect("parses"), id);
        let json = serde_json::to_string(&id).expect("serialises");
        assert_eq!(serde_json::from_str::<UniqueId>(&json).expect("parses"), id);
    }

    #[test]
    fn bad_hex_is_a_typed_error() {
        assert!(matches!(
            UniqueId::from_hex("abc"),
            Err(CollectiveError::InvalidArgument { .. })
        ));
        assert!(UniqueId::from_hex(&"zz".repeat(UNIQUE_ID_BYTES)).is_err());
        assert!(
            UniqueId::from_hex(&"+0".repeat(UNIQUE_ID_BYTES)).is_err(),
            "a sign is not a hex digit"
        );
        assert!(UniqueId::from_hex(&"0+".repeat(UNIQUE_ID_BYTES)).is_err());
        assert!(serde_json::from_str::<UniqueId>("\"00\"").is_err());
    }
}
