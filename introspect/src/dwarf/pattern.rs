//! SystemTap-style name patterns: shell globs over function names and source paths.

/// Whether `path` matches the file pattern `pattern` as a whole or in its trailing
/// components (`fs/open.c` matches `fs/open.c` and `*/open.c` and `open.c`).
pub fn file_matches(path: &str, pattern: &str) -> bool {
    if glob_match(pattern, path) {
        return true;
    }
    path.match_indices('/')
        .any(|(at, _)| glob_match(pattern, &path[at + 1..]))
}

/// Shell-style glob: `*` any run, `?` one character, `[abc]`/`[a-z]`/`[!a]` a class.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    // Iterative matcher with one backtrack point for the last `*` (linear in practice).
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        let step = match p.get(pi) {
            Some('*') => {
                star = Some((pi, ti));
                pi += 1;
                continue;
            }
            Some('?') => Some(pi + 1),
            Some('[') => class_match(&p, pi, t[ti]),
            Some(c) if *c == t[ti] => Some(pi + 1),
            _ => None,
        };
        match (step, star) {
            (Some(next), _) => {
                pi = next;
                ti += 1;
            }
            (None, Some((sp, st))) => {
                pi = sp + 1;
                ti = st + 1;
                star = Some((sp, st + 1));
            }
            (None, None) => return false,
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// Matches `c` against the class starting at `p[open] == '['`; the index after `]` on a match.
fn class_match(p: &[char], open: usize, c: char) -> Option<usize> {
    let mut i = open + 1;
    let negate = matches!(p.get(i), Some('!' | '^'));
    if negate {
        i += 1;
    }
    let mut hit = false;
    let mut first = true;
    while let Some(&ch) = p.get(i) {
        if ch == ']' && !first {
            return (hit != negate).then_some(i + 1);
        }
        first = false;
        if p.get(i + 1) == Some(&'-') && p.get(i + 2).is_some_and(|&e| e != ']') {
            hit |= ch <= c && c <= p[i + 2];
            i += 3;
        } else {
            hit |= ch == c;
            i += 1;
        }
    }
    // No closing bracket: a literal '['.
    (c == '[').then_some(open + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob_matches_stars_questions_and_classes() {
        assert!(glob_match("vfs_*", "vfs_read"));
        assert!(glob_match("*", ""));
        assert!(glob_match("v?s_read", "vfs_read"));
        assert!(glob_match("vfs_[rw]*", "vfs_write"));
        assert!(glob_match("vfs_[!w]*", "vfs_read"));
        assert!(glob_match("[a-c]x", "bx"));
        assert!(glob_match("*_read*", "do_vfs_read_iter"));
        assert!(!glob_match("vfs_*", "do_vfs_read"));
        assert!(!glob_match("vfs_[!r]*", "vfs_read"));
        assert!(!glob_match("a?", "a"));
    }

    #[test]
    fn glob_treats_an_unclosed_bracket_as_a_literal() {
        assert!(glob_match("a[", "a["));
        assert!(!glob_match("a[", "ab"));
    }

    #[test]
    fn file_matches_whole_paths_and_trailing_components() {
        assert!(file_matches("fs/open.c", "fs/open.c"));
        assert!(file_matches("fs/open.c", "open.c"));
        assert!(file_matches("fs/open.c", "*/open.c"));
        assert!(file_matches("fs/open.c", "fs/*.c"));
        assert!(!file_matches("fs/xfs/open.c", "fs/open.c"));
        assert!(!file_matches("fs/reopen.c", "open.c"));
    }
}
