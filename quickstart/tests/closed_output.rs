//! The quickstart writing to an output whose reader goes away after three lines, as
//! `| head -3` does: the procedure still ends SUCCESS, and the run says so.

extern crate proctor_quickstart as proctor;

#[allow(dead_code)]
#[path = "../examples/quickstart.rs"]
mod quickstart;

use std::io::{self, Write};
use std::sync::{Arc, Mutex};

/// An output that takes `lines` lines, then fails every write as a closed pipe does.
struct Closing {
    lines: usize,
    taken: Arc<Mutex<Vec<u8>>>,
}

impl Write for Closing {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.lines == 0 {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        let mut taken = self.taken.lock().unwrap();
        for &byte in buf {
            if self.lines == 0 {
                break;
            }
            taken.push(byte);
            if byte == b'\n' {
                self.lines -= 1;
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[actix::test]
async fn a_reader_that_goes_away_does_not_fail_the_procedure() {
    let taken = Arc::new(Mutex::new(Vec::new()));
    let out = Closing {
        lines: 3,
        taken: taken.clone(),
    };
    let ended = quickstart::run(out).await;
    assert!(ended.is_ok(), "{:?}", ended.err());
    let taken = String::from_utf8(taken.lock().unwrap().clone()).unwrap();
    assert_eq!(taken.lines().count(), 3, "{taken}");
}
