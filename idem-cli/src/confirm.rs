//! Asking before a command changes anything.

use std::io::{BufRead, IsTerminal, Write};

use crate::error::{Error, Result};

/// Goes ahead if `yes`; otherwise asks "`action`? [y/N]" on the terminal. Without a
/// terminal on stdin there is nobody to ask, so it refuses.
pub fn confirm(action: &str, yes: bool) -> Result<()> {
    if yes {
        return Ok(());
    }
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        return Err(Error::NotConfirmed {
            action: action.to_owned(),
            why: "stdin is not a terminal, so pass --yes",
        });
    }
    let mut err = std::io::stderr().lock();
    write!(err, "{action}? [y/N] ")
        .and_then(|()| err.flush())
        .map_err(|e| Error::io("ask for confirmation", e))?;
    let mut answer = String::new();
    stdin
        .lock()
        .read_line(&mut answer)
        .map_err(|e| Error::io("read the confirmation", e))?;
    if is_yes(&answer) {
        Ok(())
    } else {
        Err(Error::NotConfirmed {
            action: action.to_owned(),
            why: "the answer was not yes",
        })
    }
}

fn is_yes(answer: &str) -> bool {
    matches!(answer.trim().to_ascii_lowercase().as_str(), "y" | "yes")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_yes_is_yes() {
        for a in ["y\n", "Y", " yes ", "YES\r\n"] {
            assert!(is_yes(a), "{a:?}");
        }
        for a in ["", "\n", "n", "no", "yess", "ok"] {
            assert!(!is_yes(a), "{a:?}");
        }
    }
}
