//! The `cuweave` binary and the `cuweave` facade used the way a user does: every documented
//! subcommand and flag, bad input of every kind (unknown flags, negative and non-numeric sizes,
//! unwritable outputs, reports and calibration files that are missing, empty, malformed, from
//! another machine or with negative figures) answered with a message and a non-zero status and
//! never a panic; without a GPU, `info` and `bench` saying so; with one, `info` listing the device,
//! `bench` at its smallest size writing JSON that parses and an SVG that is well formed, and the
//! calibration file it saves loading back into the transfer manager through the facade.
//!
//! GPU checks start with `require_gpu!` (skipped without a GPU, failing instead with
//! `CUWEAVE_REQUIRE_GPU=1`); no check depends on timing.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

use cuweave::driver::{self, Device};
use cuweave::transfer::{CalibrationTable, TransferError};
use cuweave_test_support::require_gpu;
use serde_json::Value;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// The `cuweave` binary: beside this test in a `cargo xtask gpu-test` bundle (`bin/` next to
/// `tests/`), else the one cargo built for this test (as in `tests/cli.rs`).
fn cuweave_binary() -> PathBuf {
    let exe = format!("cuweave{}", std::env::consts::EXE_SUFFIX);
    let bundled = std::env::current_exe()
        .ok()
        .and_then(|test| Some(test.parent()?.parent()?.join("bin").join(&exe)))
        .filter(|path| path.is_file());
    bundled.unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_cuweave")))
}

fn command(args: &[&str]) -> Command {
    let mut command = Command::new(cuweave_binary());
    command.args(args).stdin(Stdio::null());
    command
}

fn run(args: &[&str]) -> Output {
    command(args)
        .output()
        .unwrap_or_else(|error| panic!("running cuweave {}: {error}", args.join(" ")))
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn describe(args: &[&str], output: &Output) -> String {
    format!(
        "cuweave {} exited with {}\nstdout:\n{}\nstderr:\n{}",
        args.join(" "),
        output.status,
        stdout(output),
        stderr(output)
    )
}

/// No run may panic, whatever it was given.
fn assert_no_panic(args: &[&str], output: &Output) {
    assert!(
        !stderr(output).contains("panicked") && !stdout(output).contains("panicked"),
        "{}",
        describe(args, output)
    );
    // A panic exits 101; a signal has no code at all.
    assert!(
        output.status.code().is_some_and(|code| code != 101),
        "{}",
        describe(args, output)
    );
}

/// A usage or input error: a non-zero status, a message on stderr that contains every one of
/// `mentions`, and no panic.
fn assert_refused(args: &[&str], mentions: &[&str]) -> Output {
    let output = run(args);
    assert_no_panic(args, &output);
    assert!(!output.status.success(), "{}", describe(args, &output));
    let err = stderr(&output);
    assert!(!err.trim().is_empty(), "{}", describe(args, &output));
    for mention in mentions {
        assert!(
            err.contains(mention),
            "expected `{mention}` in stderr; {}",
            describe(args, &output)
        );
    }
    output
}

/// Success (status 0), no panic; returns the output.
fn assert_succeeds(args: &[&str]) -> Output {
    let output = run(args);
    assert_no_panic(args, &output);
    assert!(output.status.success(), "{}", describe(args, &output));
    output
}

/// A directory of its own under the system's temporary directory, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "cuweave-cli-user-{}-{}-{name}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("creating a scratch directory");
        Self(dir)
    }

    fn file(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, contents).expect("writing a scratch file");
        path
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn arg(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 scratch path")
}

/// Whether this process finds no CUDA driver at all (the binary sees the same machine).
fn no_driver() -> bool {
    matches!(driver::driver(), Err(error) if error.is_not_found())
}

/// A bench report as `cuweave bench --json` writes it, measured on another machine, with
/// characters that must be escaped in XML in a method name.
const FOREIGN_REPORT: &str = r#"{
  "device": "NVIDIA A100-SXM4-40GB",
  "sizes": [4096, 1048576],
  "iterations": 3,
  "series": [
    {"direction": "H2D", "method": "raw pinned (cuMemcpyHtoD)", "cuweave": false,
     "points": [{"bytes": 4096, "gbps": 0.5}, {"bytes": 1048576, "gbps": 20.0}]},
    {"direction": "H2D", "method": "cuweave <staged> & co", "cuweave": true,
     "points": [{"bytes": 1048576, "gbps": 25.0}]},
    {"direction": "D2D", "method": "raw (cuMemcpyDtoD)", "cuweave": false,
     "points": [{"bytes": 4096, "gbps": 2.0}, {"bytes": 1048576, "gbps": 900.0}]}
  ],
  "latency": [{"name": "H2D raw pinned", "micros": 5.5}],
  "staging": {"chunk_bytes": 4194304, "depth": 2, "threads": 12}
}"#;

/// Checks that `text` is a well-formed XML document whose root is `<svg>`, and that every
/// coordinate attribute (and every `points` pair) is a finite number. Returns the element names
/// in document order.
fn check_svg(text: &str) -> Result<Vec<String>, String> {
    const NUMERIC: [&str; 11] = [
        "x", "y", "x1", "y1", "x2", "y2", "cx", "cy", "r", "width", "height",
    ];
    fn check_entities(text: &str, at: usize) -> Result<(), String> {
        let mut rest = text;
        while let Some(amp) = rest.find('&') {
            let after = &rest[amp + 1..];
            let end = after
                .find(';')
                .ok_or_else(|| format!("a bare `&` near byte {at}"))?;
            let entity = &after[..end];
            let known = matches!(entity, "amp" | "lt" | "gt" | "quot" | "apos")
                || entity
                    .strip_prefix("#x")
                    .is_some_and(|hex| u32::from_str_radix(hex, 16).is_ok())
                || entity
                    .strip_prefix('#')
                    .is_some_and(|dec| dec.parse::<u32>().is_ok());
            if !known {
                return Err(format!("unknown entity `&{entity};` near byte {at}"));
            }
            rest = &after[end + 1..];
        }
        Ok(())
    }
    fn finite(value: &str, what: &str) -> Result<(), String> {
        match value.trim().parse::<f64>() {
            Ok(number) if number.is_finite() => Ok(()),
            _ => Err(format!("{what} is `{value}`, not a finite number")),
        }
    }

    let mut stack: Vec<String> = Vec::new();
    let mut names = Vec::new();
    let mut roots = 0;
    let mut i = 0;
    let bytes = text.as_bytes();
    while i < text.len() {
        let Some(open) = text[i..].find('<') else {
            if !text[i..].trim().is_empty() && stack.is_empty() {
                return Err("text after the root element".to_owned());
            }
            check_entities(&text[i..], i)?;
            break;
        };
        let content = &text[i..i + open];
        if stack.is_empty() && !content.trim().is_empty() {
            return Err(format!("text outside the root element near byte {i}"));
        }
        check_entities(content, i)?;
        i += open;
        let rest = &text[i..];
        if let Some(body) = rest.strip_prefix("<?") {
            i += 2 + body.find("?>").ok_or("an unclosed `<?`")? + 2;
            continue;
        }
        if let Some(body) = rest.strip_prefix("<!--") {
            i += 4 + body.find("-->").ok_or("an unclosed comment")? + 3;
            continue;
        }
        if let Some(body) = rest.strip_prefix("</") {
            let end = body.find('>').ok_or("an unclosed end tag")?;
            let name = body[..end].trim();
            match stack.pop() {
                Some(open) if open == name => {}
                other => return Err(format!("`</{name}>` closes {other:?}")),
            }
            i += 2 + end + 1;
            continue;
        }
        // A start tag: a name, attributes with quoted values, then `>` or `/>`.
        i += 1;
        let name_end = text[i..]
            .find(|c: char| c.is_whitespace() || c == '>' || c == '/')
            .ok_or("an unclosed start tag")?;
        let name = &text[i..i + name_end];
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_alphanumeric() || "-_:.".contains(c))
        {
            return Err(format!("a bad element name `{name}` near byte {i}"));
        }
        if stack.is_empty() {
            roots += 1;
        }
        names.push(name.to_owned());
        i += name_end;
        let mut seen: Vec<&str> = Vec::new();
        let self_closing = loop {
            while i < text.len() && bytes[i].is_ascii_whitespace() {
                i += 1;
            }
            let rest = &text[i..];
            if rest.starts_with("/>") {
                i += 2;
                break true;
            }
            if rest.starts_with('>') {
                i += 1;
                break false;
            }
            let eq = rest
                .find('=')
                .ok_or_else(|| format!("an attribute without `=` in <{name}>"))?;
            let attr = rest[..eq].trim();
            if attr.is_empty() || attr.contains(char::is_whitespace) || attr.contains(['<', '>']) {
                return Err(format!("a bad attribute name `{attr}` in <{name}>"));
            }
            if seen.contains(&attr) {
                return Err(format!("attribute `{attr}` twice in <{name}>"));
            }
            seen.push(attr);
            let after = rest[eq + 1..].trim_start();
            let skipped = rest[eq + 1..].len() - after.len();
            let quote = after
                .chars()
                .next()
                .filter(|c| *c == '"' || *c == '\'')
                .ok_or_else(|| format!("attribute `{attr}` of <{name}> is not quoted"))?;
            let close = after[1..]
                .find(quote)
                .ok_or_else(|| format!("attribute `{attr}` of <{name}> is not closed"))?;
            let value = &after[1..1 + close];
            if value.contains('<') {
                return Err(format!("a `<` in attribute `{attr}` of <{name}>"));
            }
            check_entities(value, i)?;
            if NUMERIC.contains(&attr) {
                finite(value, &format!("<{name} {attr}>"))?;
            }
            if attr == "points" {
                for pair in value.split_whitespace() {
                    let (x, y) = pair
                        .split_once(',')
                        .ok_or_else(|| format!("a point `{pair}` without a comma"))?;
                    finite(x, "a polyline x")?;
                    finite(y, "a polyline y")?;
                }
            }
            i += eq + 1 + skipped + 1 + close + 1;
        };
        if !self_closing {
            stack.push(name.to_owned());
        }
    }
    if let Some(open) = stack.last() {
        return Err(format!("<{open}> is never closed"));
    }
    if roots != 1 || names.first().map(String::as_str) != Some("svg") {
        return Err(format!(
            "{roots} root elements, the first {:?}",
            names.first()
        ));
    }
    Ok(names)
}

// ---------------------------------------------------------------------------------------------
// The command line: help, version, every documented flag, usage errors
// ---------------------------------------------------------------------------------------------

/// The bench flags the docs show a user: every `--flag` on a `cuweave bench` / `-- bench`
/// command line of README.md and docs/transfer.md, and every backquoted `--flag` of the
/// `cuweave bench` section.
fn documented_bench_flags() -> Vec<String> {
    const README: &str = include_str!("../../../README.md");
    const TRANSFER: &str = include_str!("../../../docs/transfer.md");
    let mut flags: Vec<String> = Vec::new();
    let mut add = |flag: &str| {
        let flag = flag.trim_end_matches(|c: char| !(c.is_ascii_alphanumeric() || c == '-'));
        if flag.len() > 2 && !flags.iter().any(|f| f == flag) {
            flags.push(flag.to_owned());
        }
    };
    for text in [README, TRANSFER] {
        for line in text.lines() {
            for start in ["cuweave bench ", "-- bench "] {
                let mut rest = line;
                while let Some(at) = rest.find(start) {
                    rest = &rest[at + start.len()..];
                    for token in rest.split_whitespace() {
                        if token.starts_with('#') || token.starts_with('`') || token == "|" {
                            break;
                        }
                        if token.starts_with("--") {
                            add(token);
                        }
                    }
                }
            }
        }
    }
    let section = TRANSFER
        .split("\n## `cuweave bench`")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("docs/transfer.md has a `cuweave bench` section");
    for quoted in section.split('`').skip(1).step_by(2) {
        if quoted.starts_with("--") && !quoted.contains(' ') {
            add(quoted);
        }
    }
    flags
}

#[test]
fn every_bench_flag_the_docs_show_exists_in_bench_help() {
    let documented = documented_bench_flags();
    for flag in [
        "--sizes",
        "--json",
        "--plot",
        "--save-calibration",
        "--from-json",
        "--iterations",
    ] {
        assert!(
            documented.iter().any(|f| f == flag),
            "the docs no longer show {flag}: {documented:?}"
        );
    }
    let help = stdout(&assert_succeeds(&["bench", "--help"]));
    for flag in &documented {
        assert!(
            help.contains(flag.as_str()),
            "documented {flag} is not in `cuweave bench --help`:\n{help}"
        );
    }
    // `help bench` is the same text.
    assert_eq!(stdout(&assert_succeeds(&["help", "bench"])), help);
    let info = stdout(&assert_succeeds(&["info", "--help"]));
    assert!(info.contains("--json"), "{info}");
}

#[test]
fn top_level_help_and_version_exit_zero_and_name_both_subcommands() {
    for args in [&["--help"][..], &["-h"], &["help"]] {
        let text = stdout(&assert_succeeds(args));
        assert!(text.contains("Usage: cuweave"), "{text}");
        for subcommand in ["info", "bench"] {
            assert!(
                text.lines().any(|l| l.trim_start().starts_with(subcommand)),
                "`cuweave {}` does not list {subcommand}:\n{text}",
                args.join(" ")
            );
        }
    }
    let expected = format!("cuweave {}", env!("CARGO_PKG_VERSION"));
    for flag in ["--version", "-V"] {
        assert_eq!(stdout(&assert_succeeds(&[flag])).trim_end(), expected);
    }
}

#[test]
fn no_subcommand_unknown_subcommands_and_unknown_flags_are_usage_errors() {
    // No subcommand: the usage on stderr, status 2 (clap's usage error).
    let output = assert_refused(&[], &["Usage: cuweave"]);
    assert_eq!(output.status.code(), Some(2));
    for (args, mentions) in [
        (&["frobnicate"][..], &["frobnicate"][..]),
        (&["INFO"], &["INFO"]),
        (&["help", "frobnicate"], &["frobnicate"]),
        (&["--frobnicate"], &["--frobnicate"]),
        (&["info", "--bogus"], &["--bogus"]),
        (&["info", "--json", "extra"], &["extra"]),
        (&["info", "--version"], &["--version"]),
        (&["bench", "--version"], &["--version"]),
        (&["bench", "--bogus"], &["--bogus"]),
        // There is no output-format flag: the formats are the table and --json.
        (&["bench", "--format", "xml"], &["--format"]),
        (&["info", "--format", "yaml"], &["--format"]),
        (&["bench", "--json", "--json"], &["--json"]),
    ] {
        let output = assert_refused(args, mentions);
        assert_eq!(output.status.code(), Some(2), "{}", describe(args, &output));
        assert!(stdout(&output).is_empty(), "{}", describe(args, &output));
    }
}

#[test]
fn bad_bench_values_are_refused_before_anything_is_measured() {
    for (args, mentions) in [
        (
            &["bench", "--sizes", "abc"][..],
            &["--sizes", "abc", "is not a size"][..],
        ),
        (&["bench", "--sizes", "4X"], &["--sizes", "unknown unit"]),
        (&["bench", "--sizes", "1T"], &["--sizes", "unknown unit"]),
        (&["bench", "--sizes", "1.5M"], &["--sizes", "1.5M"]),
        (
            &["bench", "--sizes", "0"],
            &["--sizes", "zero or too large"],
        ),
        (
            &["bench", "--sizes", "0K"],
            &["--sizes", "zero or too large"],
        ),
        (
            &["bench", "--sizes", "99999999999G"],
            &["--sizes", "zero or too large"],
        ),
        (&["bench", "--sizes", "4K,,8K"], &["--sizes"]),
        (&["bench", "--sizes="], &["--sizes"]),
        (&["bench", "--sizes"], &["--sizes", "a value is required"]),
        // Negative sizes: clap reads `-4K` as a flag; refused all the same.
        (&["bench", "--sizes", "-4K"], &["-4"]),
        (&["bench", "--sizes=-4K"], &["--sizes", "-4K"]),
        (&["bench", "--iterations", "0"], &["--iterations", "0"]),
        (&["bench", "--iterations", "-1"], &["-1"]),
        (&["bench", "--iterations=-1"], &["--iterations", "-1"]),
        (
            &["bench", "--iterations", "five"],
            &["--iterations", "five"],
        ),
        (
            &["bench", "--iterations", "70000"],
            &["--iterations", "70000"],
        ),
        (&["bench", "--plot"], &["--plot", "a value is required"]),
        (&["bench", "--save-calibration"], &["--save-calibration"]),
        (&["bench", "--from-json"], &["--from-json"]),
        // A replayed report measures nothing, so sizes and a calibration cannot go with it.
        (
            &["bench", "--from-json", "r.json", "--sizes", "4K"],
            &["--sizes", "--from-json"],
        ),
        (
            &[
                "bench",
                "--from-json",
                "r.json",
                "--save-calibration",
                "c.json",
            ],
            &["--save-calibration", "--from-json"],
        ),
        // A replay repeats nothing: the report says how many runs its medians came from.
        (
            &["bench", "--from-json", "r.json", "--iterations", "9"],
            &["--iterations", "--from-json"],
        ),
    ] {
        let output = assert_refused(args, mentions);
        assert_eq!(output.status.code(), Some(2), "{}", describe(args, &output));
        assert!(stdout(&output).is_empty(), "{}", describe(args, &output));
    }
}

// ---------------------------------------------------------------------------------------------
// `bench --from-json`: the CLI's one input file
// ---------------------------------------------------------------------------------------------

#[test]
fn a_saved_report_replays_as_a_table_json_and_a_well_formed_plot() {
    let scratch = Scratch::new("replay");
    let report = scratch.file("a100.json", FOREIGN_REPORT);
    let plot = scratch.path("a100.svg");

    let table = stdout(&assert_succeeds(&["bench", "--from-json", arg(&report)]));
    assert!(
        table.starts_with("cuweave bench: NVIDIA A100-SXM4-40GB (median of 3 runs"),
        "{table}"
    );
    assert!(
        table.contains("\nH2D\n") && table.contains("\nD2D\n"),
        "{table}"
    );
    assert!(table.contains("cuweave <staged> & co"), "{table}");
    assert!(table.contains("H2D raw pinned"), "{table}");

    // --json prints the same report back, parseable, equal to what was read.
    let json = stdout(&assert_succeeds(&[
        "bench",
        "--from-json",
        arg(&report),
        "--json",
    ]));
    let printed: Value = serde_json::from_str(&json).expect("bench --from-json --json prints JSON");
    let mut original: Value = serde_json::from_str(FOREIGN_REPORT).unwrap();
    // Reports from before the concurrent cases read as having none.
    original["concurrent"] = serde_json::json!([]);
    assert_eq!(printed, original);

    // --plot writes a well-formed SVG: a panel per direction, a line per series.
    let output = assert_succeeds(&["bench", "--from-json", arg(&report), "--plot", arg(&plot)]);
    assert_eq!(
        stdout(&output),
        table,
        "--plot does not change what is printed"
    );
    let svg = std::fs::read_to_string(&plot).expect("--plot wrote the file");
    let elements = check_svg(&svg).unwrap_or_else(|error| panic!("{error}\n{svg}"));
    assert_eq!(
        elements.iter().filter(|e| *e == "polyline").count(),
        3,
        "{svg}"
    );
    assert!(
        svg.contains(">H2D</text>") && svg.contains(">D2D</text>"),
        "{svg}"
    );
    assert!(svg.contains("cuweave &lt;staged&gt; &amp; co"), "{svg}");
    assert!(svg.contains("NVIDIA A100-SXM4-40GB"), "{svg}");

    // The JSON printed can itself be replayed (a program's round trip).
    let again = scratch.file("again.json", &json);
    let replayed = stdout(&assert_succeeds(&["bench", "--from-json", arg(&again)]));
    assert_eq!(replayed, table);
}

#[test]
fn reports_that_are_missing_empty_or_malformed_are_refused_with_the_file_named() {
    let scratch = Scratch::new("bad-reports");
    let missing = scratch.path("missing.json");
    let broken_object: String = FOREIGN_REPORT.replace("\"iterations\": 3,", "\"iterations\": 3");
    let cases: Vec<(&str, String, &str)> = vec![
        ("empty.json", String::new(), "EOF"),
        ("blank.json", "  \n\t\n".to_owned(), "EOF"),
        (
            "truncated.json",
            FOREIGN_REPORT[..FOREIGN_REPORT.len() / 2].to_owned(),
            "EOF",
        ),
        ("syntax.json", broken_object, "expected"),
        ("array.json", "[1, 2, 3]".to_owned(), "invalid type"),
        ("null.json", "null".to_owned(), "invalid type"),
        (
            "other.json",
            r#"{"hello": "world"}"#.to_owned(),
            "missing field",
        ),
        (
            "negative-iterations.json",
            FOREIGN_REPORT.replace("\"iterations\": 3", "\"iterations\": -3"),
            "-3",
        ),
        (
            "negative-size.json",
            FOREIGN_REPORT.replace("[4096, 1048576]", "[-4096, 1048576]"),
            "-4096",
        ),
        (
            "string-size.json",
            FOREIGN_REPORT.replace("[4096, 1048576]", "[\"4K\", 1048576]"),
            "invalid type",
        ),
        (
            "negative-chunk.json",
            FOREIGN_REPORT.replace("\"chunk_bytes\": 4194304", "\"chunk_bytes\": -1"),
            "-1",
        ),
        // Parsed, then refused as the calibration loader refuses such figures.
        (
            "negative-bandwidth.json",
            FOREIGN_REPORT.replace("\"gbps\": 20.0", "\"gbps\": -20.0"),
            "-20 is not a measured figure",
        ),
        (
            "negative-latency.json",
            FOREIGN_REPORT.replace("\"micros\": 5.5", "\"micros\": -5.5"),
            "latency H2D raw pinned",
        ),
        (
            "zero-iterations.json",
            FOREIGN_REPORT.replace("\"iterations\": 3", "\"iterations\": 0"),
            "`iterations` is 0",
        ),
        (
            "two-byte-size.json",
            FOREIGN_REPORT.replace("[4096, 1048576]", "[2, 1048576]"),
            "2 bytes",
        ),
    ];
    let mut paths = vec![(missing.clone(), "No such file".to_owned())];
    for (name, contents, mention) in &cases {
        paths.push((scratch.file(name, contents), (*mention).to_owned()));
    }
    // Not UTF-8.
    let binary = scratch.path("binary.json");
    std::fs::write(&binary, [0xff, 0xfe, 0x00, 0x7b]).unwrap();
    paths.push((binary, "UTF-8".to_owned()));
    // A directory.
    paths.push((scratch.0.clone(), String::new()));

    for (path, mention) in &paths {
        for extra in [&[][..], &["--json"], &["--plot", "never.svg"]] {
            let mut args = vec!["bench", "--from-json", arg(path)];
            args.extend_from_slice(extra);
            let output = assert_refused(&args, &["cuweave: reading", arg(path), mention]);
            assert_eq!(
                output.status.code(),
                Some(2),
                "{}",
                describe(&args, &output)
            );
            assert!(stdout(&output).is_empty(), "{}", describe(&args, &output));
        }
    }
    assert!(
        !Path::new("never.svg").exists(),
        "a refused report wrote its plot"
    );
}

#[test]
fn unwritable_plot_paths_exit_2_with_the_path_named_and_no_report_printed() {
    let scratch = Scratch::new("unwritable");
    let report = scratch.file("report.json", FOREIGN_REPORT);
    let no_parent = scratch.path("no/such/dir/plot.svg");
    for target in [no_parent.as_path(), scratch.0.as_path()] {
        let args = ["bench", "--from-json", arg(&report), "--plot", arg(target)];
        let output = assert_refused(&args, &["cuweave: writing", arg(target)]);
        assert_eq!(
            output.status.code(),
            Some(2),
            "{}",
            describe(&args, &output)
        );
        assert!(stdout(&output).is_empty(), "{}", describe(&args, &output));
    }
    assert!(!no_parent.exists());
}

#[cfg(target_os = "linux")]
#[test]
fn a_full_stdout_is_an_error_of_status_2_for_info_and_bench() {
    let scratch = Scratch::new("full");
    let report = scratch.file("report.json", FOREIGN_REPORT);
    let full = Path::new("/dev/full");
    if !full.exists() {
        cuweave_test_support::skip("a_full_stdout_is_an_error", "no /dev/full here");
        return;
    }
    for args in [
        &["info"][..],
        &["info", "--json"],
        &["bench", "--from-json", arg(&report)],
        &["bench", "--from-json", arg(&report), "--json"],
    ] {
        let sink = std::fs::OpenOptions::new().write(true).open(full).unwrap();
        let output = command(args)
            .stdout(sink)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert_no_panic(args, &output);
        assert_eq!(output.status.code(), Some(2), "{}", describe(args, &output));
        assert!(
            stderr(&output).contains("cuweave: writing the report failed"),
            "{}",
            describe(args, &output)
        );
    }
}

#[test]
fn a_reader_that_stops_early_is_not_an_error() {
    let scratch = Scratch::new("pipe");
    let report = scratch.file("report.json", FOREIGN_REPORT);
    for args in [
        &["info"][..],
        &["info", "--json"],
        &["bench", "--from-json", arg(&report)],
    ] {
        let mut child = command(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Close the read end at once: whether the write lands before or after, it must not fail.
        drop(child.stdout.take());
        let output = child.wait_with_output().unwrap();
        assert_no_panic(args, &output);
        assert!(output.status.success(), "{}", describe(args, &output));
    }
}

#[test]
fn odd_reports_replay_without_a_panic_and_plot_well_formed_xml() {
    // Hand-edited reports the bench never writes: no sizes, no series, one size, another
    // machine's device names with XML characters, negative bandwidth. Each is shown (or refused
    // with a message), never a panic, and any plot written is well-formed XML.
    let scratch = Scratch::new("odd");
    let mut cases = vec![
        ("no-sizes", FOREIGN_REPORT.replace("[4096, 1048576]", "[]")),
        (
            "one-size",
            FOREIGN_REPORT.replace("[4096, 1048576]", "[4096]"),
        ),
        (
            "negative-gbps",
            FOREIGN_REPORT.replace("\"gbps\": 20.0", "\"gbps\": -20.0"),
        ),
        (
            "xml-device",
            FOREIGN_REPORT.replace("NVIDIA A100-SXM4-40GB", "GPU <0> & \"friends\" 'x'"),
        ),
    ];
    let mut empty: Value = serde_json::from_str(FOREIGN_REPORT).unwrap();
    empty["series"] = serde_json::json!([]);
    empty["latency"] = serde_json::json!([]);
    cases.push(("no-series", empty.to_string()));
    for (name, contents) in cases {
        let report = scratch.file(&format!("{name}.json"), &contents);
        let plot = scratch.path(&format!("{name}.svg"));
        let args = ["bench", "--from-json", arg(&report), "--plot", arg(&plot)];
        let output = run(&args);
        assert_no_panic(&args, &output);
        match output.status.code() {
            Some(0) => {
                let svg = std::fs::read_to_string(&plot).expect("a plot on success");
                check_svg(&svg).unwrap_or_else(|error| panic!("{name}: {error}\n{svg}"));
            }
            Some(2) => assert!(
                stderr(&output).contains("cuweave:"),
                "{}",
                describe(&args, &output)
            ),
            _ => panic!("{}", describe(&args, &output)),
        }
    }
}

/// A regression test: a report holding a size of 0 bytes (which `--sizes 0` refuses) replayed
/// with status 0 and a plot whose coordinates were all `NaN` (`log2(0)` is -inf, and
/// `-inf - -inf` is NaN). A 0-byte size is now drawn where 1 byte would be.
#[test]
fn a_report_with_a_zero_byte_size_is_refused_or_plotted_with_finite_coordinates() {
    let scratch = Scratch::new("zero-size");
    let report = scratch.file(
        "zero.json",
        &FOREIGN_REPORT
            .replace("[4096, 1048576]", "[0, 4096]")
            .replace(
                "{\"bytes\": 4096, \"gbps\": 0.5}",
                "{\"bytes\": 0, \"gbps\": 0.5}",
            ),
    );
    let plot = scratch.path("zero.svg");
    let args = ["bench", "--from-json", arg(&report), "--plot", arg(&plot)];
    let output = run(&args);
    assert_no_panic(&args, &output);
    if output.status.success() {
        let svg = std::fs::read_to_string(&plot).unwrap();
        check_svg(&svg).unwrap_or_else(|error| panic!("{error}\n{svg}"));
    } else {
        assert_eq!(
            output.status.code(),
            Some(2),
            "{}",
            describe(&args, &output)
        );
    }
}

// ---------------------------------------------------------------------------------------------
// No GPU driver: what `info` and `bench` say
// ---------------------------------------------------------------------------------------------

#[test]
fn without_a_driver_info_and_bench_say_so_and_exit_zero() {
    if !no_driver() {
        cuweave_test_support::skip(
            "without_a_driver_info_and_bench_say_so_and_exit_zero",
            "a CUDA driver is present",
        );
        return;
    }
    let info = stdout(&assert_succeeds(&["info"]));
    assert!(
        info.starts_with("no CUDA driver found: looked for libcuda.so"),
        "{info}"
    );
    // The bench's documented answer, whatever the flags (outputs are never written: there is
    // nothing to write, so even an unwritable plot path is not reached).
    let scratch = Scratch::new("no-driver");
    let plot = scratch.path("plot.svg");
    let calibration = scratch.path("calibration.json");
    for args in [
        &["bench"][..],
        &["bench", "--sizes", "4K", "--iterations", "1"],
        &["bench", "--sizes", "4K,1G", "--plot", arg(&plot)],
        &[
            "bench",
            "--sizes",
            "4K",
            "--save-calibration",
            arg(&calibration),
        ],
        &["bench", "--sizes", "4K", "--plot", "/no/such/dir/plot.svg"],
    ] {
        let output = assert_succeeds(args);
        let text = stdout(&output);
        assert!(
            text.starts_with(
                "cuweave bench: nothing to measure: no CUDA driver found: looked for "
            ),
            "{}",
            describe(args, &output)
        );
        assert_eq!(text.lines().count(), 1, "{}", describe(args, &output));
    }
    assert!(
        !plot.exists() && !calibration.exists(),
        "nothing measured, nothing written"
    );
}

/// A regression test: `cuweave bench --json` on a machine without a driver printed the plain
/// sentence `cuweave bench: nothing to measure: …` and exited 0, so a program reading `--json`
/// got text that does not parse. It now answers in JSON (`"error": "nothing to measure: …"`), as
/// `info --json` does.
#[test]
fn without_a_driver_bench_json_still_prints_json() {
    if !no_driver() {
        return;
    }
    let args = ["bench", "--sizes", "4K", "--json"];
    let output = assert_succeeds(&args);
    let text = stdout(&output);
    assert!(
        text.trim().is_empty() || serde_json::from_str::<Value>(&text).is_ok(),
        "stdout of `--json` is not JSON: {}",
        describe(&args, &output)
    );
}

// ---------------------------------------------------------------------------------------------
// Calibration files through the facade (the CLI writes them; programs load them)
// ---------------------------------------------------------------------------------------------

/// The calibration file example of docs/transfer.md.
const DOCUMENTED_CALIBRATION: &str = r#"{ "device": "NVIDIA H100 80GB HBM3",
  "devices": ["NVIDIA H100 80GB HBM3"],
  "staging": [ { "path": { "src": "pageable", "dst": "device", "cross_device": false },
                 "device": 0, "bytes": 4194304,
                 "config": { "chunk_bytes": 524288, "depth": 2, "threads": 3,
                             "host_copy": "Streaming" }, "gbps": 24.0 } ],
  "entries": [ { "path": { "src": "pageable", "dst": "device", "cross_device": false },
                 "size_class": "medium", "method": "host_staged", "gbps": 24.0,
                 "bytes": 4194304, "dst_device": 0 } ],
  "registration": { "fixed_ms": 0.25, "ms_per_mib": 0.075 } }"#;

#[test]
fn the_documented_calibration_file_loads_and_names_its_machine() {
    let scratch = Scratch::new("documented-calibration");
    let path = scratch.file("calibration.json", DOCUMENTED_CALIBRATION);
    let table = CalibrationTable::load(&path).expect("the docs' example loads");
    assert_eq!(table.device.as_deref(), Some("NVIDIA H100 80GB HBM3"));
    assert_eq!(table.entries.len(), 1);
    assert_eq!(table.staging.len(), 1);
    assert!(!table.is_empty());
    // Saved and loaded again, it is the same table.
    let copy = scratch.path("copy.json");
    table.save(&copy).unwrap();
    assert_eq!(CalibrationTable::load(&copy).unwrap(), table);
    // On the machine it names it is at home; anywhere else the mismatch says where it came from
    // and what to do.
    assert!(
        table
            .check_machine(&["NVIDIA H100 80GB HBM3".to_owned()])
            .is_none()
    );
    let mismatch = table
        .check_machine(&["NVIDIA H200".to_owned(), "NVIDIA H200".to_owned()])
        .expect("another machine is a mismatch");
    let message = mismatch.to_string();
    assert!(message.contains("NVIDIA H100 80GB HBM3"), "{message}");
    assert!(message.contains("NVIDIA H200 + NVIDIA H200"), "{message}");
    assert!(message.contains("recalibrate"), "{message}");
}

#[test]
fn calibration_files_that_are_missing_empty_malformed_or_negative_are_typed_errors() {
    let scratch = Scratch::new("bad-calibration");
    let negative = |from: &str, to: &str| {
        assert!(DOCUMENTED_CALIBRATION.contains(from), "{from}");
        DOCUMENTED_CALIBRATION.replacen(from, to, 1)
    };
    let cases: Vec<(&str, String, &str)> = vec![
        ("empty.json", String::new(), "EOF"),
        (
            "truncated.json",
            DOCUMENTED_CALIBRATION[..60].to_owned(),
            "EOF",
        ),
        (
            "array.json",
            "[]".to_owned(),
            "expected struct CalibrationTable",
        ),
        ("report.json", FOREIGN_REPORT.to_owned(), "invalid type"),
        (
            "negative-gbps.json",
            negative(
                "\"host_staged\", \"gbps\": 24.0",
                "\"host_staged\", \"gbps\": -24.0",
            ),
            "a bandwidth of -24",
        ),
        (
            "negative-staging-gbps.json",
            negative(
                "\"gbps\": 24.0 } ],\n  \"entries\"",
                "\"gbps\": -1.5 } ],\n  \"entries\"",
            ),
            "a staging bandwidth of -1.5",
        ),
        (
            "negative-fixed.json",
            negative("\"fixed_ms\": 0.25", "\"fixed_ms\": -0.25"),
            "the fixed registration cost of -0.25",
        ),
        (
            "negative-per-mib.json",
            negative("\"ms_per_mib\": 0.075", "\"ms_per_mib\": -0.075"),
            "per MiB of -0.075",
        ),
        (
            "negative-bytes.json",
            negative("\"bytes\": 4194304, \"dst", "\"bytes\": -1, \"dst"),
            "-1",
        ),
        (
            "negative-device.json",
            negative("\"dst_device\": 0", "\"dst_device\": -1"),
            "-1",
        ),
        (
            "negative-chunk.json",
            negative("\"chunk_bytes\": 524288", "\"chunk_bytes\": -524288"),
            "-524288",
        ),
        (
            "zero-chunk.json",
            negative("\"chunk_bytes\": 524288", "\"chunk_bytes\": 0"),
            "chunk_bytes",
        ),
        (
            "zero-depth.json",
            negative("\"depth\": 2", "\"depth\": 0"),
            "depth",
        ),
        (
            "huge-threads.json",
            negative("\"threads\": 3", "\"threads\": 100000"),
            "threads",
        ),
        (
            "unknown-method.json",
            negative("\"host_staged\"", "\"teleport\""),
            "teleport",
        ),
        (
            "huge-gbps.json",
            negative("\"gbps\": 24.0 } ]", "\"gbps\": 1e400 } ]"),
            "",
        ),
    ];
    for (name, contents, mention) in &cases {
        let path = scratch.file(name, contents);
        match CalibrationTable::load(&path) {
            Err(error @ TransferError::CalibrationFile { .. }) => {
                let message = error.to_string();
                assert!(message.contains(arg(&path)), "{name}: {message}");
                assert!(
                    message.contains(mention),
                    "{name}: expected `{mention}` in {message}"
                );
            }
            Err(other) => panic!("{name}: not a CalibrationFile error: {other:?}"),
            Ok(table) => panic!("{name} loaded: {table:?}"),
        }
        // The same text through from_json, as a program holding it in memory would.
        assert!(
            matches!(
                CalibrationTable::from_json(contents),
                Err(TransferError::CalibrationFile { .. })
            ),
            "{name}"
        );
    }
    let missing = scratch.path("missing.json");
    let error = CalibrationTable::load(&missing).expect_err("a missing file");
    assert!(
        matches!(error, TransferError::CalibrationFile { .. }),
        "{error:?}"
    );
    assert!(error.to_string().contains(arg(&missing)), "{error}");
    let error = CalibrationTable::load(&scratch.0).expect_err("a directory");
    assert!(
        matches!(error, TransferError::CalibrationFile { .. }),
        "{error:?}"
    );
    // Saving where nothing can be written is the same typed error, naming the file.
    let unwritable = scratch.path("no/such/dir/calibration.json");
    let error = CalibrationTable::h100_defaults()
        .save(&unwritable)
        .expect_err("no such directory");
    assert!(
        matches!(error, TransferError::CalibrationFile { .. }),
        "{error:?}"
    );
    assert!(error.to_string().contains(arg(&unwritable)), "{error}");
}

// ---------------------------------------------------------------------------------------------
// The facade: what README and the crate docs say it re-exports
// ---------------------------------------------------------------------------------------------

/// Compile-time: the names README's examples and `cuweave`'s feature table use, reachable through
/// the facade's modules and prelude (the CLI turns on `driver`, `transfer` and `collective`, which
/// imply `memory`, `event` and `stream`: every layer).
#[allow(dead_code, clippy::type_complexity)]
fn the_facade_names_every_documented_type() {
    use cuweave::prelude::*;
    fn named<T: ?Sized>() {}
    // driver
    named::<(
        Context,
        Device,
        DriverError,
        Event,
        EventFlags,
        EventPool,
        Stream,
        StreamFlags,
    )>();
    named::<(PooledEvent<'static>, OwnedPooledEvent)>();
    named::<(
        cuweave::driver::InstantiateOptions,
        cuweave::driver::Graph,
        cuweave::driver::Module,
    )>();
    let _: &[&str] = cuweave::driver::loader::LIBRARY_CANDIDATES;
    // memory
    named::<(
        DeviceBuffer<f32>,
        PinnedBuffer<u8>,
        UnifiedBuffer<u32>,
        CachingAllocator,
        PinnedPool,
    )>();
    named::<(
        MemAdvice,
        MemLocation,
        MemoryError,
        MemoryStats,
        MigrationPolicy,
        PrefetchPlan<'static>,
    )>();
    named::<(cuweave::memory::MemoryError, CachedAllocation)>();
    fn buffer<B: Buffer<f32>>() {}
    buffer::<DeviceBuffer<f32>>();
    buffer::<PinnedBuffer<f32>>();
    buffer::<UnifiedBuffer<f32>>();
    // stream
    named::<(
        StreamPool,
        StreamPoolConfig,
        StreamPriority,
        WorkloadType,
        PriorityStream,
    )>();
    named::<(
        MultiStreamCoordinator,
        StreamOrderedAllocator,
        StreamProfiler,
        StreamError,
    )>();
    named::<(AllocationStrategy, StreamMetrics)>();
    named::<(
        cuweave::stream::capture::CaptureOptions,
        cuweave::stream::capture::StreamCapture<'static>,
    )>();
    // event
    named::<(
        OperationCoordinator,
        OperationType,
        EventPriority,
        CrossStreamBarrier,
    )>();
    named::<(AsyncEventWaiter, EventError, WaitFuture, WakeMechanism)>();
    named::<cuweave::event::EventPool>();
    // transfer
    named::<(
        TransferManager,
        TransferError,
        TransferMethod,
        TransferDirection,
        Location,
        Plan,
    )>();
    named::<(
        CalibrationTable,
        StagingConfig,
        RegistrationAdvice,
        TransferReport,
    )>();
    named::<(
        Source<'static, f32>,
        Destination<'static, f32>,
        RegisteredHost<'static, f32>,
    )>();
    // collective
    named::<(
        Communicator,
        CommConfig,
        ReduceOp,
        UniqueId,
        CollectiveError,
        Group<'static>,
    )>();
    named::<CoordinatedCollectives>();
}

#[test]
fn the_facade_layers_are_the_layer_crates_and_fail_without_a_driver_in_typed_errors() {
    // The facade's driver layer is the one the binary uses: the same loader, the same answer.
    assert_eq!(cuweave::driver::is_available(), driver::driver().is_ok());
    // The event layer's pool is the driver's (one pool, re-exported).
    let same: fn() -> std::any::TypeId = std::any::TypeId::of::<cuweave::event::EventPool>;
    assert_eq!(same(), std::any::TypeId::of::<cuweave::driver::EventPool>());
    // Pure values need no GPU: the H100 defaults name their machine and round-trip as JSON.
    let defaults = CalibrationTable::h100_defaults();
    assert!(!defaults.is_empty());
    assert_eq!(defaults.devices, [cuweave::transfer::DEFAULT_MACHINE]);
    assert_eq!(
        CalibrationTable::from_json(&defaults.to_json()).unwrap(),
        defaults
    );
    assert!(
        cuweave::prelude::StagingConfig::for_upload(64 << 20)
            .validate()
            .is_ok()
    );
    if !no_driver() {
        return;
    }
    // README: "a machine without a driver gets a typed error, never a panic".
    let not_found = |error: &cuweave::driver::DriverError| error.is_not_found();
    assert!(Device::count().is_err_and(|e| not_found(&e)));
    assert!(Device::get(0).is_err_and(|e| not_found(&e)));
    assert!(Device::all().is_err_and(|e| not_found(&e)));
    match cuweave::transfer::TransferManager::new() {
        Err(TransferError::Driver(error)) => assert!(error.is_not_found(), "{error}"),
        Err(other) => panic!("not the driver's NotFound: {other:?}"),
        Ok(_) => panic!("a transfer manager without a driver"),
    }
    assert!(cuweave::transfer::TransferManager::for_devices(&[0]).is_err());
    // NCCL loads or says why; a unique id needs it, and is a typed error without it.
    match cuweave::collective::nccl() {
        Ok(nccl) => assert!(!nccl.version().to_string().is_empty()),
        Err(error) => {
            assert!(!error.to_string().is_empty());
            assert!(cuweave::collective::UniqueId::new().is_err());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// With a GPU
// ---------------------------------------------------------------------------------------------

/// The shortest bench the CLI allows: one size (4 KiB) and one timed copy per point.
const SHORT_BENCH: [&str; 5] = ["bench", "--sizes", "4K", "--iterations", "1"];

#[test]
fn info_lists_each_device_with_its_capabilities() {
    let gpu = require_gpu!();
    let text = stdout(&assert_succeeds(&["info"]));
    let devices = Device::all().unwrap();
    let name = gpu.device.name().unwrap();
    assert!(text.contains(&format!("\ndevice 0: {name}\n")), "{text}");
    let header = match devices.len() {
        1 => "\n1 device\n".to_owned(),
        n => format!("\n{n} devices\n"),
    };
    assert!(text.contains(&header), "{text}");
    let cc = gpu.device.compute_capability().unwrap();
    let caps = gpu.device.capabilities().unwrap();
    let yes_no = |flag: bool| if flag { "yes" } else { "no" };
    let row = |label: &str, value: String| {
        let wanted = format!("  {label:<27}{value}");
        assert!(
            text.lines().any(|l| l == wanted),
            "no line `{wanted}` in:\n{text}"
        );
    };
    row("compute capability", format!("{}.{}", cc.major, cc.minor));
    row("PCI bus id", gpu.device.pci_bus_id().unwrap());
    row(
        "multiprocessors (SMs)",
        caps.multiprocessor_count.to_string(),
    );
    row("async copy engines", caps.async_engine_count.to_string());
    row("managed memory", yes_no(caps.managed_memory).to_owned());
    row(
        "concurrent managed access",
        yes_no(caps.concurrent_managed_access).to_owned(),
    );
    row(
        "pageable memory access",
        yes_no(caps.pageable_memory_access).to_owned(),
    );
    row(
        "memory pools",
        yes_no(caps.memory_pools_supported).to_owned(),
    );
    row(
        "unified addressing",
        yes_no(caps.unified_addressing).to_owned(),
    );
    row(
        "can map host memory",
        yes_no(caps.can_map_host_memory).to_owned(),
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("  memory ") && l.contains("GiB total")),
        "{text}"
    );
    assert!(
        text.lines().any(|l| l.starts_with("  stream priorities")),
        "{text}"
    );
    assert!(text.contains("peer access"), "{text}");
    assert!(!text.contains("error:"), "{text}");
}

#[test]
fn the_shortest_bench_writes_json_an_svg_and_a_calibration_the_manager_loads() {
    let gpu = require_gpu!();
    let _one_bench_at_a_time = cuweave_test_support::serial();
    let scratch = Scratch::new("gpu-bench");
    let plot = scratch.path("bandwidth.svg");
    let calibration = scratch.path("calibration.json");
    let mut args = SHORT_BENCH.to_vec();
    args.extend([
        "--json",
        "--plot",
        arg(&plot),
        "--save-calibration",
        arg(&calibration),
    ]);
    let output = assert_succeeds(&args);

    // stdout is the JSON report and nothing else.
    let json = stdout(&output);
    let report: Value = serde_json::from_str(&json)
        .unwrap_or_else(|error| panic!("{error}: {}", describe(&args, &output)));
    assert_eq!(report["device"], gpu.device.name().unwrap());
    assert_eq!(report["sizes"], serde_json::json!([4096]));
    assert_eq!(report["iterations"], 1);
    let series = report["series"].as_array().expect("series");
    let devices = Device::count().unwrap();
    assert_eq!(series.len(), if devices > 1 { 15 } else { 12 }, "{json}");
    for direction in ["H2D", "D2H", "D2D"] {
        assert!(
            series.iter().any(|s| s["direction"] == direction),
            "no {direction}: {json}"
        );
    }
    for s in series {
        assert!(s["method"].is_string() && s["cuweave"].is_boolean(), "{s}");
        let points = s["points"].as_array().expect("points");
        assert_eq!(points.len(), 1, "{s}");
        assert_eq!(points[0]["bytes"], 4096);
        let gbps = points[0]["gbps"].as_f64().expect("a number");
        assert!(gbps.is_finite() && gbps > 0.0, "{s}");
    }
    let latency = report["latency"].as_array().expect("latency");
    assert_eq!(latency.len(), 8, "{json}");
    assert!(
        latency.iter().all(|l| l["micros"]
            .as_f64()
            .is_some_and(|m| m.is_finite() && m > 0.0)),
        "{json}"
    );
    assert_eq!(
        report["concurrent"].as_array().map(Vec::len),
        Some(2),
        "{json}"
    );
    for key in ["chunk_bytes", "depth", "threads"] {
        assert!(
            report["staging"][key].as_u64().is_some_and(|v| v > 0),
            "{json}"
        );
    }

    // The plot is well formed, with a panel per direction measured.
    let svg = std::fs::read_to_string(&plot).expect("--plot wrote the SVG");
    let elements = check_svg(&svg).unwrap_or_else(|error| panic!("{error}\n{svg}"));
    assert_eq!(
        elements.iter().filter(|e| *e == "polyline").count(),
        series.len()
    );
    assert!(
        svg.contains(">H2D</text>") && svg.contains(">D2H</text>") && svg.contains(">D2D</text>")
    );

    // The report replays through --from-json exactly.
    let saved = scratch.file("bench.json", &json);
    let replayed = stdout(&assert_succeeds(&[
        "bench",
        "--from-json",
        arg(&saved),
        "--json",
    ]));
    assert_eq!(serde_json::from_str::<Value>(&replayed).unwrap(), report);

    // The calibration file loads back and drives a transfer manager made through the facade.
    use cuweave::prelude::*;
    let table =
        CalibrationTable::load(&calibration).expect("bench --save-calibration wrote a table");
    assert!(!table.is_empty() && !table.entries.is_empty(), "{table:?}");
    let manager = TransferManager::new().unwrap();
    assert_eq!(
        table.devices,
        manager.machine(),
        "the file names this machine's devices"
    );
    assert!(table.check_machine(&manager.machine()).is_none());
    assert_eq!(
        manager.set_calibration(table.clone()),
        None,
        "measured here: no mismatch"
    );
    assert_eq!(manager.calibration(), table);
    let plan = manager
        .plan(Location::PageableHost, Location::Device(0), 4 << 20)
        .to_string();
    assert!(!plan.contains("not this machine"), "{plan}");
    let host: Vec<f32> = (0..4096).map(|i| i as f32).collect();
    let mut device = DeviceBuffer::<f32>::new(&gpu.context, host.len()).unwrap();
    manager.transfer(&host, &mut device).unwrap();
    let mut back = vec![0.0f32; 100];
    manager
        .transfer(Source::device(&device, 1000, 100), &mut back)
        .unwrap();
    assert_eq!(back[..], host[1000..1100]);

    // A table from another machine still loads, and the manager says so.
    let foreign = CalibrationTable::from_json(DOCUMENTED_CALIBRATION).unwrap();
    if foreign.check_machine(&manager.machine()).is_some() {
        let mismatch = manager.set_calibration(foreign).expect("a mismatch");
        assert!(
            mismatch.to_string().contains("NVIDIA H100 80GB HBM3"),
            "{mismatch}"
        );
        let plan = manager
            .plan(Location::PageableHost, Location::Device(0), 4 << 20)
            .to_string();
        assert!(
            plan.contains("not this machine") || plan.contains("H100"),
            "{plan}"
        );
    }
}

#[test]
fn with_a_gpu_unwritable_outputs_fail_with_the_path_named() {
    let _gpu = require_gpu!();
    let _one_bench_at_a_time = cuweave_test_support::serial();
    let scratch = Scratch::new("gpu-unwritable");
    let plot = scratch.path("no/such/dir/plot.svg");
    let mut args = SHORT_BENCH.to_vec();
    args.extend(["--plot", arg(&plot)]);
    let output = assert_refused(&args, &["cuweave: writing", arg(&plot)]);
    assert_eq!(
        output.status.code(),
        Some(2),
        "{}",
        describe(&args, &output)
    );
    // The calibration is measured (the CLI cannot shorten it) before the file is found unwritable.
    let calibration = scratch.path("no/such/dir/calibration.json");
    let mut args = SHORT_BENCH.to_vec();
    args.extend(["--save-calibration", arg(&calibration)]);
    assert_refused(&args, &["calibration", arg(&calibration)]);
}

/// A regression test: `--sizes` took 1 to 3 bytes, but the latency rows always copy 4 bytes out
/// of buffers of the largest size (crates/cuweave-cli/src/bench/measure.rs) and the four-thread
/// case takes a quarter of it, so `bench --sizes 1` panicked on a GPU. Sizes under 4 bytes are
/// now refused when the arguments are read, before any driver call, with or without a GPU.
#[test]
fn sizes_under_four_bytes_are_refused_never_a_panic() {
    for tiny in ["1", "3", "2b"] {
        let args = ["bench", "--sizes", tiny, "--iterations", "1", "--json"];
        let output = assert_refused(&args, &["--sizes", "under 4 bytes"]);
        assert_eq!(
            output.status.code(),
            Some(2),
            "{}",
            describe(&args, &output)
        );
    }
}
