//! Guards the layering of `src/` (docs/ARCHITECTURE.md, "Modules"): no import cycle
//! between the crate's modules, so data moves down through rooms instead of out and
//! back to a hub.
//!
//! It reads every `.rs` file under `src/` (the binary's folder aside), takes the
//! top-level module each belongs to (`src/log/commit.rs` belongs to `log`), collects
//! every `crate::<module>` path outside comments as an edge, and fails naming each
//! cycle it finds. A planted cycle (an edge from `addr` back to `index`) is checked
//! to be caught, so the test cannot pass by reading nothing. A second test keeps
//! every file under `src/` (the simulator aside) at 600 lines or fewer.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Graph = BTreeMap<String, BTreeSet<String>>;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "bin") {
                rust_files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module of a file under `src/`.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let relative = file.strip_prefix(src).ok()?;
    let first = relative.components().next()?.as_os_str().to_str()?;
    let name = first.trim_end_matches(".rs");
    (name != "lib").then(|| name.to_string())
}

/// Every `crate::name` (and `crate::{a, b}` group head) in `code`, comments skipped.
fn referenced(code: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in code.lines() {
        let line = line.split("//").next().unwrap_or("");
        let mut rest = line;
        while let Some(at) = rest.find("crate::") {
            let after = &rest[at + "crate::".len()..];
            if let Some(group) = after.strip_prefix('{') {
                let inner = group.split('}').next().unwrap_or("");
                for part in inner.split(',') {
                    let name: String = part
                        .trim()
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    names.insert(name);
                }
            } else {
                let name: String = after
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                names.insert(name);
            }
            rest = after;
        }
    }
    names
}

fn graph() -> Graph {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let modules: BTreeSet<String> = files.iter().filter_map(|f| module_of(&src, f)).collect();
    let mut graph = Graph::new();
    for file in &files {
        let Some(module) = module_of(&src, file) else {
            continue;
        };
        let code = std::fs::read_to_string(file).unwrap();
        let edges = graph.entry(module.clone()).or_default();
        for name in referenced(&code) {
            if name != module && modules.contains(&name) {
                edges.insert(name);
            }
        }
    }
    graph
}

/// Every cycle, each as the path of modules that closes it.
fn cycles(graph: &Graph) -> Vec<Vec<String>> {
    fn visit(
        graph: &Graph,
        node: &str,
        stack: &mut Vec<String>,
        done: &mut BTreeSet<String>,
        found: &mut Vec<Vec<String>>,
    ) {
        if let Some(at) = stack.iter().position(|n| n == node) {
            let mut cycle = stack[at..].to_vec();
            cycle.push(node.to_string());
            found.push(cycle);
            return;
        }
        if done.contains(node) {
            return;
        }
        stack.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            visit(graph, next, stack, done, found);
        }
        stack.pop();
        done.insert(node.to_string());
    }
    let mut found = Vec::new();
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        visit(graph, node, &mut Vec::new(), &mut done, &mut found);
    }
    found
}

#[test]
fn the_modules_of_src_import_each_other_without_cycles() {
    let graph = graph();
    assert!(
        graph.len() >= 15 && graph.contains_key("store") && graph.contains_key("addr"),
        "read too little of src/: {:?}",
        graph.keys()
    );
    let found = cycles(&graph);
    assert!(
        found.is_empty(),
        "import cycles between modules: {}",
        found
            .iter()
            .map(|c| c.join(" -> "))
            .collect::<Vec<_>>()
            .join("; ")
    );

    // A planted edge from the leaf back up must be caught.
    let mut planted = graph.clone();
    planted.get_mut("addr").unwrap().insert("index".to_string());
    assert!(
        cycles(&planted)
            .iter()
            .any(|c| c.contains(&"addr".to_string())),
        "a planted addr -> index edge was not seen as a cycle"
    );
}

#[test]
fn no_file_under_src_is_a_hub_of_over_600_lines_but_the_simulator() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    assert!(files.len() >= 30, "read too few files: {}", files.len());
    let simulator = src.join("io").join("sim.rs");
    let long: Vec<String> = files
        .iter()
        .filter(|f| **f != simulator)
        .filter_map(|f| {
            let lines = std::fs::read_to_string(f).unwrap().lines().count();
            (lines > 600).then(|| format!("{} ({lines} lines)", f.display()))
        })
        .collect();
    assert!(long.is_empty(), "files over 600 lines: {long:?}");
}
