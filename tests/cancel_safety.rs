//! Every public async function of the workspace says, in a `# Cancel
//! safety` section of its documentation, what dropping its future before it
//! resolves does: the house rule, checked here so that a new one cannot
//! leave it out.

use std::fs;
use std::path::{Path, PathBuf};

/// The `.rs` files below `dir`, in a stable order.
fn sources(dir: &Path, found: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap_or_else(|err| panic!("cannot read {}: {err}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            sources(&path, found);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            found.push(path);
        }
    }
}

/// The public async functions of `text` (as `line: signature`) whose
/// documentation has no `# Cancel safety` section.
fn undocumented(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut missing = Vec::new();
    for (at, line) in lines.iter().enumerate() {
        let signature = line.trim_start();
        if !signature.starts_with("pub async fn ") {
            continue;
        }
        // The doc comment and attributes right above the signature.
        let documented = lines[..at]
            .iter()
            .rev()
            .map(|line| line.trim_start())
            .take_while(|line| line.starts_with("///") || line.starts_with("#["))
            .any(|line| line.starts_with("/// # Cancel safety"));
        if !documented {
            missing.push(format!("{}: {signature}", at + 1));
        }
    }
    missing
}

#[test]
fn every_public_async_function_documents_its_cancel_safety() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    sources(&root.join("src"), &mut files);
    for entry in fs::read_dir(root.join("crates")).unwrap() {
        let src = entry.unwrap().path().join("src");
        if src.is_dir() {
            sources(&src, &mut files);
        }
    }
    let mut missing = Vec::new();
    let mut checked = 0;
    for file in &files {
        let text = fs::read_to_string(file).unwrap();
        checked += text.matches("pub async fn ").count();
        for place in undocumented(&text) {
            missing.push(format!("{}:{place}", file.strip_prefix(root).unwrap().display()));
        }
    }
    // The library alone has dozens: finding none means the walk is broken.
    assert!(checked > 30, "only {checked} public async functions found");
    assert!(
        missing.is_empty(),
        "public async functions without a `# Cancel safety` section:\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_check_sees_a_section_left_out_and_ignores_the_next_functions() {
    let text = "/// Does it.\n///\n/// # Cancel safety\n/// Cancel safe.\npub async fn kept() {}\n\n\
                /// Does it.\n#[must_use]\npub async fn bare() {}\n";
    assert_eq!(undocumented(text), ["9: pub async fn bare() {}"]);
}
