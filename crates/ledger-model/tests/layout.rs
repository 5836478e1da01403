//! The layout rule of CONTRIBUTING.md: no module of the extension (`src/`) or of the core imports
//! a module that imports it back, directly or through others. A submodule counts as its top
//! module (`crate::tool_calls::claim` is `tool_calls`), test modules included.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

type Graph = BTreeMap<String, BTreeSet<String>>;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("a source directory") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The text without comments and string literals, which may name modules without using them.
fn code_of(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            '/' if chars.peek() == Some(&'*') => {
                chars.next();
                let mut last = ' ';
                for c in chars.by_ref() {
                    if last == '*' && c == '/' {
                        break;
                    }
                    last = c;
                }
            }
            '"' => {
                while let Some(c) = chars.next() {
                    match c {
                        '\\' => {
                            chars.next();
                        }
                        '"' => break,
                        _ => {}
                    }
                }
                out.push_str("\"\"");
            }
            // A char literal such as '"' or '{' (a lifetime has no closing quote: left as it is).
            '\'' => {
                let rest: String = chars.clone().take(3).collect();
                let mut it = rest.chars();
                match (it.next(), it.next(), it.next()) {
                    (Some('\\'), Some(_), Some('\'')) => {
                        chars.nth(2);
                    }
                    (Some(_), Some('\''), _) => {
                        chars.nth(1);
                    }
                    _ => out.push(c),
                }
            }
            c => out.push(c),
        }
    }
    out
}

fn ident_at(code: &str) -> String {
    code.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// The top-level names of a `{a, b::c, d as e}` group that starts just after its `{`.
fn group_names(code: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut depth = 1;
    let mut at_item = true;
    for (i, c) in code.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            ',' if depth == 1 => at_item = true,
            c if depth == 1 && at_item && (c.is_alphanumeric() || c == '_') => {
                names.push(ident_at(&code[i..]));
                at_item = false;
            }
            _ => {}
        }
    }
    names
}

/// The module graph of the crate whose root is `src/lib.rs`.
fn graph(src: &Path) -> Graph {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let top = |path: &Path| -> String {
        let rel = path.strip_prefix(src).expect("under src");
        let first = rel.iter().next().expect("a file").to_string_lossy();
        first.trim_end_matches(".rs").to_owned()
    };
    let modules: BTreeSet<String> = files.iter().map(|f| top(f)).collect();
    let mut graph = Graph::new();
    for file in &files {
        let from = top(file);
        let code = code_of(&fs::read_to_string(file).expect("a source file"));
        let mut names = Vec::new();
        for (i, _) in code.match_indices("crate::") {
            let rest = &code[i + "crate::".len()..];
            match rest.strip_prefix('{') {
                Some(group) => names.extend(group_names(group)),
                None => names.push(ident_at(rest)),
            }
        }
        if from == "lib" {
            // The crate root names its modules without `crate::`.
            for (i, _) in code.match_indices("::") {
                let before = &code[..i];
                let start = before
                    .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .map_or(0, |p| p + 1);
                let preceded_by_path = before[..start].ends_with("::");
                if !preceded_by_path {
                    names.push(before[start..].to_owned());
                }
            }
        }
        let edges = graph.entry(from.clone()).or_default();
        edges.extend(
            names
                .into_iter()
                .filter(|n| n != &from && modules.contains(n)),
        );
    }
    graph
}

/// Every module that can reach itself again, with the modules on the way back.
fn cycles(graph: &Graph) -> Vec<(String, BTreeSet<String>)> {
    let reachable = |start: &str| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo: Vec<&str> = vec![start];
        while let Some(m) = todo.pop() {
            for next in graph.get(m).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    todo.push(next);
                }
            }
        }
        seen
    };
    graph
        .keys()
        .filter_map(|m| {
            let from_m = reachable(m);
            from_m.contains(m).then(|| {
                let back: BTreeSet<String> = from_m
                    .into_iter()
                    .filter(|n| n != m && reachable(n).contains(m))
                    .collect();
                (m.clone(), back)
            })
        })
        .collect()
}

fn assert_no_cycles(src: &Path) {
    let graph = graph(src);
    assert!(graph.len() > 10, "{} read as a crate", src.display());
    let found = cycles(&graph);
    assert!(
        found.is_empty(),
        "modules of {} that import themselves back (module, through): {found:?}",
        src.display()
    );
}

#[test]
fn no_module_of_the_extension_imports_one_that_imports_it_back() {
    assert_no_cycles(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../src"));
}

#[test]
fn no_module_of_the_core_imports_one_that_imports_it_back() {
    assert_no_cycles(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
}

/// The check finds a cycle where there is one, so that its silence means something.
#[test]
fn a_cycle_is_found() {
    let dir = std::env::temp_dir().join(format!("ledger-layout-{}", std::process::id()));
    fs::create_dir_all(dir.join("b")).expect("a temporary directory");
    let write = |name: &str, text: &str| fs::write(dir.join(name), text).expect("a file");
    write("lib.rs", "mod a;\nmod b;\nfn f() { a::g(); }\n");
    write("a.rs", "use crate::{b::inner::h, c};\npub fn g() {}\n");
    write(
        "b.rs",
        "mod inner;\n// crate::c is named in a comment only\n",
    );
    write(
        "b/inner.rs",
        "pub fn h() { let _ = \"crate::c\"; crate::a::g(); }\n",
    );
    write("c.rs", "pub fn c() {}\n");
    let graph = graph(&dir);
    fs::remove_dir_all(&dir).expect("cleaned up");
    assert_eq!(graph["lib"], BTreeSet::from(["a".to_owned()]));
    assert_eq!(graph["a"], BTreeSet::from(["b".to_owned(), "c".to_owned()]));
    assert_eq!(graph["b"], BTreeSet::from(["a".to_owned()]));
    let found = cycles(&graph);
    let names: Vec<&str> = found.iter().map(|(m, _)| m.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
}
