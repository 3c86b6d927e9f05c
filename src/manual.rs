//! `exotap man` and `exotap completions`: the manual pages and shell completions, generated
//! from the same clap definitions that parse the command line (`clap_mangen`, `clap_complete`),
//! so that they cannot fall out of step with it.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::CommandFactory;

/// Arguments of `exotap man`.
#[derive(Debug, clap::Args)]
pub struct ManArgs {
    /// Directory for the pages: `exotap.1` and one `exotap-SUBCOMMAND.1` per subcommand
    /// (`man ./exotap.1` reads one; install them under a `man1/` of `manpath`).
    #[arg(long, short, value_name = "DIR", default_value = "target/man")]
    pub out: PathBuf,
}

/// Arguments of `exotap completions`.
#[derive(Debug, clap::Args)]
pub struct CompletionsArgs {
    /// The shell: bash, zsh, fish, elvish or powershell.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

/// Writes every page into `args.out`, creating it, and prints each path.
///
/// # Errors
/// When the directory or a page cannot be written.
pub fn run_man(args: &ManArgs) -> anyhow::Result<i32> {
    for page in write_pages(&args.out)? {
        outln!("{}", page.display());
    }
    Ok(0)
}

/// The pages of exotap's command tree in `dir` (created): `exotap.1`, then one per visible
/// subcommand, nested ones included (`exotap-image-fetch.1`); their paths, the top page first.
///
/// # Errors
/// When the directory or a page cannot be written.
pub fn write_pages(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    clap_mangen::generate_to(crate::Cli::command(), dir)
        .with_context(|| format!("cannot write the pages into {}", dir.display()))?;
    let mut pages = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let path = entry?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        if name.is_some_and(|n| n.starts_with("exotap") && n.ends_with(".1")) {
            pages.push(path);
        }
    }
    pages.sort_by_key(|p| (p.file_name() != Some("exotap.1".as_ref()), p.clone()));
    Ok(pages)
}

/// Prints the completion script of `args.shell` on standard output.
///
/// # Errors
/// Never today; a `Result` as every command's.
pub fn run_completions(args: &CompletionsArgs) -> anyhow::Result<i32> {
    let mut cmd = crate::Cli::command();
    let mut bytes = Vec::new();
    clap_complete::generate(args.shell, &mut cmd, "exotap", &mut bytes);
    out!("{}", String::from_utf8_lossy(&bytes));
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every visible subcommand has its page, and each page is roff naming its command and
    /// carrying the options clap parses (the page of `count` documents `--target`).
    #[test]
    fn every_subcommand_gets_a_page_with_its_options() {
        let dir = tempfile::tempdir().unwrap();
        let pages = write_pages(dir.path()).unwrap();
        let names: Vec<String> = pages
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        let cmd = crate::Cli::command();
        for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
            let want = format!("exotap-{}.1", sub.get_name());
            assert!(names.contains(&want), "no page {want} in {names:?}");
        }
        assert!(!names.iter().any(|n| n == "exotap-guardian.1"), "{names:?}");
        assert_eq!(names[0], "exotap.1");
        let count = std::fs::read_to_string(dir.path().join("exotap-count.1")).unwrap();
        assert!(
            count.starts_with(".ie \\n(.g .ds Aq"),
            "not roff: {}",
            &count[..80]
        );
        assert!(count.contains(".TH exotap-count 1"), "{count}");
        assert!(count.contains("\\-\\-target"), "{count}");
        // Nested subcommands get theirs: `exotap image fetch`.
        assert!(
            names.iter().any(|n| n == "exotap-image-fetch.1"),
            "{names:?}"
        );
    }

    #[test]
    fn bash_completion_names_the_subcommands() {
        let mut cmd = crate::Cli::command();
        let mut bytes = Vec::new();
        clap_complete::generate(clap_complete::Shell::Bash, &mut cmd, "exotap", &mut bytes);
        let script = String::from_utf8(bytes).unwrap();
        for word in ["splice-report", "backtrace", "recover", "--target"] {
            assert!(script.contains(word), "no {word} in the bash completion");
        }
    }
}
