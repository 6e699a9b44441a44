//! The session cookie's value (TRAFFIC.md §5): which service and target a session is pinned to,
//! when it began and when it was last used. Opaque to clients and free of addresses: target ids
//! are never reused, so a new target on an old address can never receive an old session, and a
//! value naming another service's target is not this service's session.

/// Version of the layout below; a value of another version is no session.
const VERSION: u8 = 1;
/// version, service id, target id, began (unix s), last used (unix s).
const BYTES: usize = 1 + 8 + 8 + 4 + 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionCookie {
    pub service_id: i64,
    pub target_id: i64,
    /// Unix seconds when the session began (`absolute_timeout_s` counts from it).
    pub began_s: u32,
    /// Unix seconds of the session's last request (`idle_timeout_s` counts from it).
    pub used_s: u32,
}

impl SessionCookie {
    /// Lower-case hex of the fixed layout: a cookie-value without quoting.
    pub fn encode(&self) -> String {
        let mut bytes = [0u8; BYTES];
        bytes[0] = VERSION;
        bytes[1..9].copy_from_slice(&self.service_id.to_be_bytes());
        bytes[9..17].copy_from_slice(&self.target_id.to_be_bytes());
        bytes[17..21].copy_from_slice(&self.began_s.to_be_bytes());
        bytes[21..25].copy_from_slice(&self.used_s.to_be_bytes());
        hex::encode(bytes)
    }

    /// None for anything but a value `encode` could have written.
    pub fn decode(value: &str) -> Option<SessionCookie> {
        let mut bytes = [0u8; BYTES];
        hex::decode_to_slice(value, &mut bytes).ok()?;
        if bytes[0] != VERSION {
            return None;
        }
        let int =
            |range: std::ops::Range<usize>| -> Option<[u8; 8]> { bytes[range].try_into().ok() };
        let small =
            |range: std::ops::Range<usize>| -> Option<[u8; 4]> { bytes[range].try_into().ok() };
        Some(SessionCookie {
            service_id: i64::from_be_bytes(int(1..9)?),
            target_id: i64::from_be_bytes(int(9..17)?),
            began_s: u32::from_be_bytes(small(17..21)?),
            used_s: u32::from_be_bytes(small(21..25)?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_names_no_address() {
        let cookie = SessionCookie {
            service_id: 7,
            target_id: 1_234_567,
            began_s: 1_800_000_000,
            used_s: 1_800_000_100,
        };
        let value = cookie.encode();
        assert_eq!(value.len(), 50);
        assert!(value.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(SessionCookie::decode(&value), Some(cookie));
    }

    #[test]
    fn refuses_what_it_did_not_write() {
        let value = SessionCookie {
            service_id: 1,
            target_id: 2,
            began_s: 3,
            used_s: 4,
        }
        .encode();
        for bad in [
            "",
            "127.0.0.1:8080",
            &value[..48],
            &format!("{value}00"),
            &format!("02{}", &value[2..]),
            &value.replace('0', "g"),
        ] {
            assert_eq!(SessionCookie::decode(bad), None, "{bad:?}");
        }
    }
}
