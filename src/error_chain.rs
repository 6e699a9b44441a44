//! An error's chain of causes, walked in one place: told as one line for operators, searched
//! for a cause of a given type, or reduced to its innermost cause.

use std::error::Error;

/// The error itself, then each of its causes, outermost first.
pub fn causes<'a>(
    error: &'a (dyn Error + 'static),
) -> impl Iterator<Item = &'a (dyn Error + 'static)> {
    std::iter::successors(Some(error), |&error| error.source())
}

/// The first error of type `E` in the chain.
pub fn find<'a, E: Error + 'static>(error: &'a (dyn Error + 'static)) -> Option<&'a E> {
    causes(error).find_map(|cause| cause.downcast_ref::<E>())
}

/// The innermost cause: the one an operator can act on (`Connection refused (os error 111)`
/// rather than `error sending request`).
pub fn innermost<'a>(error: &'a (dyn Error + 'static)) -> &'a (dyn Error + 'static) {
    causes(error).last().unwrap_or(error)
}

/// The error and its causes as "a: b: c", skipping a cause whose words the text already holds
/// (many errors repeat their source's message in their own).
pub fn text(error: &dyn Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let words = cause.to_string();
        if !text.contains(&words) {
            text.push_str(": ");
            text.push_str(&words);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    enum Outer {
        #[error("sending failed")]
        Send(#[source] std::io::Error),
        #[error("io: {0}")]
        Repeats(#[source] std::io::Error),
    }

    fn refused() -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused")
    }

    #[test]
    fn text_joins_the_causes_once_each() {
        assert_eq!(text(&Outer::Send(refused())), "sending failed: refused");
        assert_eq!(text(&Outer::Repeats(refused())), "io: refused");
    }

    #[test]
    fn find_and_innermost_walk_the_whole_chain() {
        let error = Outer::Send(refused());
        let found = find::<std::io::Error>(&error).expect("the io error is a cause");
        assert_eq!(found.kind(), std::io::ErrorKind::ConnectionRefused);
        assert_eq!(innermost(&error).to_string(), "refused");
        assert_eq!(causes(&error).count(), 2);
        assert!(find::<std::fmt::Error>(&error).is_none());
    }
}
