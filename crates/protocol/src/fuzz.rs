//! The fuzz harness of the frame reader (fuzz/, `fuzzing` feature) and its
//! property tests: whatever bytes arrive, frames are read or refused with
//! an error, and every frame read is written back the same.

use std::io::Cursor;

use crate::{read_frame, write_frame, Frame, ProtocolError};

/// Reads frames from `data` until it is used up or refused; each frame
/// read must survive a write and a read unchanged.
pub fn frames(data: &[u8]) {
    let mut r = Cursor::new(data);
    for _ in 0..64 {
        match read_frame(&mut r) {
            Ok(frame) => round_trip(&frame),
            Err(ProtocolError::Closed) => break,
            // The stream is unusable after a short read; a refused frame
            // was consumed whole, so reading on is what a peer does.
            Err(ProtocolError::Io(_)) => break,
            Err(_) => {}
        }
    }
}

fn round_trip(frame: &Frame) {
    let mut buf = Vec::new();
    if write_frame(&mut buf, frame).is_ok() {
        let again = read_frame(&mut Cursor::new(&buf)).expect("a written frame reads back");
        assert_eq!(&again, frame, "frame changed through write and read");
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::{Message, Stream, FRAME_DATA, FRAME_MESSAGE, MAX_FRAME};

    fn framed(kind: u8, body: &[u8]) -> Vec<u8> {
        let mut v = ((body.len() + 1) as u32).to_le_bytes().to_vec();
        v.push(kind);
        v.extend_from_slice(body);
        v
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn prop_any_bytes_read_or_refused(data in proptest::collection::vec(any::<u8>(), 0..512)) {
            frames(&data);
        }

        /// Short frames, the empty one included, with any type and body.
        #[test]
        fn prop_short_frames(len in 0u32..8, rest in proptest::collection::vec(any::<u8>(), 0..16)) {
            let mut data = len.to_le_bytes().to_vec();
            data.extend_from_slice(&rest);
            frames(&data);
        }

        /// A well-framed JSON body of any shape: a message or a Decode error.
        #[test]
        fn prop_message_bodies(json in "\\{\"[a-z_]{1,12}\":(null|[0-9]{1,20}|\"[ -~]{0,20}\"|\\[\\]|\\{\\})\\}") {
            let bytes = framed(FRAME_MESSAGE, json.as_bytes());
            match read_frame(&mut Cursor::new(&bytes)) {
                Ok(f) => round_trip(&f),
                Err(e) => prop_assert!(matches!(e, ProtocolError::Decode(_)), "{e}"),
            }
        }

        #[test]
        fn prop_data_frames_round_trip(stream in 0u8..4, body in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let mut b = vec![stream];
            b.extend_from_slice(&body);
            let bytes = framed(FRAME_DATA, &b);
            let f = read_frame(&mut Cursor::new(&bytes)).expect("data frame");
            let want = [Stream::Stdin, Stream::Stdout, Stream::Stderr, Stream::File][stream as usize];
            prop_assert_eq!(&f, &Frame::Data(want, body));
            round_trip(&f);
        }

        /// A length over the limit is refused before anything is allocated.
        #[test]
        fn prop_oversized_length_refused(len in (MAX_FRAME + 1)..=u32::MAX) {
            let r = read_frame(&mut Cursor::new(len.to_le_bytes()));
            prop_assert!(matches!(r, Err(ProtocolError::TooLarge(l)) if l == len));
        }
    }

    #[test]
    fn test_message_round_trip() {
        round_trip(&Frame::Message(Message::Ping));
    }

    /// Every input under fuzz/regressions/protocol_frame/ (failures found once).
    #[test]
    fn test_fuzz_regressions_replay() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fuzz/regressions/protocol_frame");
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            frames(&std::fs::read(e.path()).expect("regression input"));
        }
    }
}
