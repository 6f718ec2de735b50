//! Unit and property tests of `core::audit`.

use super::*;
use proptest::prelude::*;

fn named(text: &str) -> (Vec<String>, Vec<String>) {
    let n = named_paths(text);
    (n.scope_hints, n.files)
}

fn fact(kind: FactKind, path: &str) -> ObservedFact {
    ObservedFact {
        kind,
        path: path.to_owned(),
    }
}

/// A fact of `kind` for each of `paths`.
fn facts(kind: FactKind, paths: &[&str]) -> Vec<ObservedFact> {
    paths.iter().map(|path| fact(kind, path)).collect()
}

fn scope(p: &[&str]) -> Scope {
    Scope::parse(&p.iter().map(|s| s.to_string()).collect::<Vec<_>>(), "s").unwrap()
}

fn input<'a>(
    named: &'a NamedPaths,
    write_scope: &'a Scope,
    observations: &'a [ObservedFact],
) -> AuditInput<'a> {
    AuditInput {
        depth: 1,
        named,
        write_scope,
        observations,
        has_report: None,
        downgrades: 0,
    }
}

#[test]
fn markdown_backticks_and_links() {
    let (dirs, files) = named(
        "Fix the expiry check in `src/auth/token.rs` (see [the docs](docs/auth.md)) \
         and **README.md**; run `cargo test`.",
    );
    assert!(dirs.is_empty());
    assert_eq!(files, ["src/auth/token.rs", "docs/auth.md", "README.md"]);
}

#[test]
fn prose_punctuation_is_not_part_of_a_path() {
    let (dirs, files) = named(
        "Look in src/auth/, then fix src/auth/token.rs. Is config.toml right? \
         Also check \"scripts/run.sh\"! And lib/util: done.",
    );
    assert_eq!(dirs, ["src/auth", "lib/util"]);
    assert_eq!(
        files,
        ["src/auth/token.rs", "config.toml", "scripts/run.sh"]
    );
}

#[test]
fn urls_are_ignored() {
    let (dirs, files) = named(
        "Spec at https://example.com/spec/v1/index.html and http://localhost:8080/api; \
         mirror ftp://host/a.tar.gz. Edit api/handler.go.",
    );
    assert!(dirs.is_empty());
    assert_eq!(files, ["api/handler.go"]);
}

#[test]
fn versions_numbers_and_abbreviations_are_not_files() {
    let (dirs, files) = named(
        "Bump to v1.2.3 (was 1.5, i.e. python3.11), e.g. like 0.1.0-rc1; \
         a 1.5x speedup by 12/05/2024, 24/7, a.k.a. fast. Use --release.",
    );
    assert!(dirs.is_empty(), "{dirs:?}");
    assert!(files.is_empty(), "{files:?}");
}

#[test]
fn paths_in_parentheses_brackets_and_quotes() {
    let (dirs, files) =
        named("Two callers (src/a.rs and src/b.rs) [see tests/it.rs] <lib/>, {'x/y.py'}.");
    assert_eq!(dirs, ["lib"]);
    assert_eq!(files, ["src/a.rs", "src/b.rs", "tests/it.rs", "x/y.py"]);
}

#[test]
fn windows_paths_home_paths_and_escapes_are_not_paths() {
    let (dirs, files) = named(
        r"Edit src\auth\token.rs or C:\repo\main.rs, not ~/notes.md, ../secret.key,
          src/../etc/passwd, (src/..) nor ./ alone.",
    );
    assert!(dirs.is_empty(), "{dirs:?}");
    assert!(files.is_empty(), "{files:?}");
}

#[test]
fn directories_by_trailing_slash_or_slash_without_extension() {
    let (dirs, files) = named("Work in src/auth/ and ./src/session, also auth/ and /etc/app/.");
    assert_eq!(dirs, ["src/auth", "src/session", "auth", "/etc/app"]);
    assert!(files.is_empty());
}

#[test]
fn duplicates_keep_first_seen_order() {
    let (dirs, files) = named("b.rs then a.rs then ./b.rs and `a.rs`; src/ then src and src/.");
    assert_eq!(dirs, ["src"]);
    assert_eq!(files, ["b.rs", "a.rs"]);
}

#[test]
fn extensionless_files_dotfiles_and_line_references() {
    let (dirs, files) = named(
        "Update Makefile, docker/Dockerfile, .env, .github/workflows and \
         src/lib.rs:42:7 (line src/main.rs:10). The makefile is fine.",
    );
    assert_eq!(dirs, [".github/workflows"]);
    assert_eq!(
        files,
        [
            "Makefile",
            "docker/Dockerfile",
            ".env",
            "src/lib.rs",
            "src/main.rs"
        ]
    );
}

#[test]
fn prose_slash_words_separators_and_flags() {
    let (dirs, files) =
        named("Read and/or write (I/O, read/write); files a.rs,b.rs|c.rs; --out=x/y.rs -v -x/y.");
    assert!(dirs.is_empty(), "{dirs:?}");
    assert_eq!(files, ["a.rs", "b.rs", "c.rs"]);
}

#[test]
fn named_paths_are_bounded() {
    let text: String = (0..MAX_NAMED_PATHS + 10)
        .map(|i| format!("f{i}.rs d{i}/ "))
        .collect();
    let n = named_paths(&text);
    assert_eq!(n.scope_hints.len() + n.files.len(), MAX_NAMED_PATHS);
    assert_eq!(n.files[0], "f0.rs");
    let long = format!("{}.rs", "a".repeat(MAX_NAMED_PATH_BYTES));
    assert_eq!(named_paths(&long), NamedPaths::default());
    let fits = format!("{}.rs", "a".repeat(MAX_NAMED_PATH_BYTES - 3));
    assert_eq!(named_paths(&fits).files, [fits]);
}

#[test]
fn acceptance_a_discovery_against_named_files() {
    let named = named_paths("Narrow it down in `src/auth/`: start from src/auth/token.rs.");
    assert_eq!(named.scope_hints, ["src/auth"]);
    assert_eq!(named.files, ["src/auth/token.rs"]);
    let mut obs = facts(
        FactKind::Read,
        &[
            "src/auth/token.rs",
            "src/auth/session.rs",
            "./docs/auth.md",
            "src/auth/token.rs",
        ],
    );
    obs.push(fact(FactKind::ToolCall, ""));
    let ws = scope(&["src/auth"]);
    let a = classify(input(&named, &ws, &obs));
    assert_eq!(a.parent_scope_hints, 1);
    assert_eq!(a.parent_named_files, 1);
    assert_eq!(a.evidence_paths, 3);
    assert_eq!(a.discovered_paths, 2);
    assert_eq!(a.tool_calls, 1);
}

#[test]
fn a_named_directory_does_not_count_as_discovery_help() {
    // Only files count: a child sent to src/auth/ still discovered.
    let named = named_paths("Look in src/auth/.");
    let obs = [fact(FactKind::Read, "src/auth/token.rs")];
    let a = classify(input(&named, &Scope::default(), &obs));
    assert_eq!((a.evidence_paths, a.discovered_paths), (1, 1));
}

#[test]
fn under_a_named_file_means_equal_or_below_by_component() {
    let named = named_paths("See pkg/mod.rs.");
    let obs = facts(
        FactKind::Read,
        &[
            "pkg/mod.rs",
            "pkg/mod.rs/inner",
            "pkg/mod.rsx",
            "pkg/mod.rs/../../etc/passwd",
        ],
    );
    let a = classify(input(&named, &Scope::default(), &obs));
    assert_eq!((a.evidence_paths, a.discovered_paths), (4, 2));
}

#[test]
fn mutations_violations_and_false_completion() {
    let named = NamedPaths::default();
    let ws = scope(&["src"]);
    let mut obs = facts(
        FactKind::Mutation,
        &[
            "src/a.rs",
            "./src/a.rs",
            "docs/x.md",
            "docs/x.md",
            "src/../etc/passwd",
        ],
    );
    obs.extend([
        fact(FactKind::Read, "src/b.rs"),
        fact(FactKind::ToolCall, "src/c.rs"),
    ]);
    let mut i = input(&named, &ws, &obs);
    i.has_report = Some(true);
    i.downgrades = 2;
    i.depth = 3;
    let a = classify(i);
    assert_eq!(a.depth, 3);
    assert_eq!(a.mutations, 5);
    assert_eq!(a.claim_violations, 3, "counted per mutation");
    assert_eq!(
        a.mutation_paths,
        ["docs/x.md", "src/../etc/passwd", "src/a.rs"]
    );
    assert_eq!(a.evidence_paths, 4, "tool call paths are not evidence");
    assert_eq!(a.tool_calls, 1);
    assert!(a.false_completion && a.completed());

    for (has_report, downgrades, expect) in [
        (None, 2, false),
        (Some(false), 2, false),
        (Some(true), 0, false),
        (Some(true), 1, true),
    ] {
        let mut i = input(&named, &ws, &obs);
        i.has_report = has_report;
        i.downgrades = downgrades;
        assert_eq!(classify(i).false_completion, expect);
    }
}

#[test]
fn conflicts_need_two_distinct_contracts() {
    let by = [
        (
            [1u8; 32],
            vec!["src/a.rs".to_owned(), "src/b.rs".to_owned()],
        ),
        (
            [2u8; 32],
            vec!["./src/a.rs".to_owned(), "src/c.rs".to_owned()],
        ),
        ([1u8; 32], vec!["src/b.rs".to_owned()]),
        (
            [3u8; 32],
            vec!["src/c.rs".to_owned(), "src/a.rs/".to_owned()],
        ),
    ];
    let c = conflicts(&by);
    assert_eq!(
        c,
        [
            Conflict {
                path: "src/a.rs".into(),
                contracts: vec![[1u8; 32], [2; 32], [3; 32]],
            },
            Conflict {
                path: "src/c.rs".into(),
                contracts: vec![[2u8; 32], [3; 32]],
            },
        ]
    );
    assert!(conflicts::<u8>(&[]).is_empty());
}

fn run(labels: &[(&str, &str)], discovered: u64, evidence: u64) -> RunTotals {
    RunTotals {
        labels: labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        sums: Sums {
            discovered,
            evidence,
            ..Sums::default()
        },
        ..RunTotals::default()
    }
}

#[test]
fn acceptance_b_rates_are_ratios_of_sums() {
    let runs = [
        run(&[("arm", "flat")], 1, 2),
        run(&[("arm", "flat")], 4, 40),
    ];
    let rows = aggregate(&runs, &["arm".to_owned()]);
    assert_eq!(rows.len(), 1);
    let rate = rows[0].discovery_rate.unwrap();
    assert_eq!(rate, 5.0 / 42.0);
    let mean_of_rates = (1.0 / 2.0 + 4.0 / 40.0) / 2.0;
    assert!((mean_of_rates - 0.3f64).abs() < 1e-12);
    assert_ne!(rate, mean_of_rates);
    assert_eq!(
        (rows[0].sums.discovered, rows[0].sums.evidence, rows[0].runs),
        (5, 42, 2)
    );
}

#[test]
fn groups_are_keyed_sorted_and_missing_labels_are_empty() {
    let mut a = run(&[("arm", "tree"), ("run", "1")], 1, 1);
    a.sums
        .refusals_by_code
        .insert("NO_RETRY_HEADROOM".into(), 2);
    a.budget_spent = 6;
    a.budget_granted = 10;
    let mut b = run(&[("arm", "flat"), ("run", "2")], 0, 3);
    b.sums
        .refusals_by_code
        .insert("NO_RETRY_HEADROOM".into(), 1);
    let c = run(&[("run", "3")], 0, 0);
    let mut d = run(&[("arm", "tree")], 0, 1);
    d.sums.refusals_by_code.insert("DEPTH".into(), 1);
    d.budget_spent = i64::MAX;
    d.budget_granted = i64::MAX;
    let rows = aggregate(&[a, b, c, d], &["arm".to_owned()]);
    let keys: Vec<&str> = rows.iter().map(|r| r.key["arm"].as_str()).collect();
    assert_eq!(keys, ["", "flat", "tree"]);
    assert_eq!(rows[0].discovery_rate, None);
    assert_eq!(rows[0].spent_over_granted, None);
    assert_eq!(rows[1].discovery_rate, Some(0.0));
    let tree = &rows[2];
    assert_eq!(tree.runs, 2);
    assert_eq!(tree.discovery_rate, Some(0.5));
    assert_eq!(
        tree.sums.refusals_by_code,
        BTreeMap::from([("DEPTH".into(), 1), ("NO_RETRY_HEADROOM".into(), 2)])
    );
    assert_eq!(tree.budget_granted, i128::from(i64::MAX) + 10);
    assert!(tree.spent_over_granted.unwrap() <= 1.0);

    let all = aggregate(&[run(&[("arm", "a")], 1, 2), run(&[], 3, 4)], &[]);
    assert_eq!(all.len(), 1);
    assert!(all[0].key.is_empty());
    assert!(aggregate(&[], &["arm".to_owned()]).is_empty());
}

#[test]
fn run_totals_sum_audits() {
    let mut t = RunTotals::default();
    for (has_report, false_completion) in [(Some(true), true), (Some(false), false), (None, false)]
    {
        t.add_audit(&Audit {
            mutations: 2,
            claim_violations: 1,
            evidence_paths: 3,
            discovered_paths: 1,
            has_report,
            false_completion,
            ..Audit::default()
        });
    }
    assert_eq!(
        (
            t.sums.contracts,
            t.sums.contracts_with_report,
            t.sums.false_completions
        ),
        (3, 1, 1)
    );
    assert_eq!(
        (
            t.sums.mutations,
            t.sums.claim_violations,
            t.sums.evidence,
            t.sums.discovered
        ),
        (6, 3, 9, 3)
    );
    let rows = aggregate(&[t], &[]);
    assert_eq!(rows[0].false_completion_rate, Some(1.0));
    assert_eq!(rows[0].claim_violations_per_mutation, Some(0.5));
}

#[test]
fn group_by_keys_are_validated() {
    let keys = |k: &[&str]| k.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        check_group_by(&keys(&["arm", "run", "arm"]), "g").unwrap(),
        ["arm", "run"]
    );
    assert!(check_group_by(&keys(&["Arm"]), "g").is_err());
    assert!(check_group_by(&keys(&[""]), "g").is_err());
    let many: Vec<String> = (0..=MAX_GROUP_BY_KEYS).map(|i| format!("k{i}")).collect();
    assert_eq!(check_group_by(&many, "g").unwrap_err().field, "g");
}

fn path_strategy() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof![
            Just("src".to_owned()),
            Just("a.rs".to_owned()),
            Just("b.md".to_owned()),
            Just(".".to_owned()),
            Just("..".to_owned()),
            Just(String::new()),
            "[a-z]{1,3}",
        ],
        1..5,
    )
    .prop_flat_map(|parts| (Just(parts.join("/")), any::<bool>(), any::<bool>()))
    .prop_map(|(p, lead, trail)| {
        let p = if lead { format!("/{p}") } else { p };
        if trail { format!("{p}/") } else { p }
    })
}

proptest! {
    #[test]
    fn named_paths_never_panic_and_are_well_formed(
        text in prop_oneof!["\\PC{0,200}", "[a-zA-Z0-9./`()\\[\\]:~ *-]{0,120}"]
    ) {
        let n = named_paths(&text);
        prop_assert!(n.scope_hints.len() + n.files.len() <= MAX_NAMED_PATHS);
        for p in n.scope_hints.iter().chain(&n.files) {
            prop_assert!(!p.is_empty() && p.len() <= MAX_NAMED_PATH_BYTES);
            prop_assert!(p.bytes().all(is_path_byte));
            prop_assert!(!p.ends_with('/'));
            let rel = p.strip_prefix('/').unwrap_or(p);
            prop_assert!(rel.split('/').all(|c| !c.is_empty() && c != "." && c != ".."));
        }
    }

    #[test]
    fn named_paths_round_trip(
        words in prop::collection::vec(
            prop_oneof![
                "[a-z]{1,6}(/[a-z]{1,6}){0,3}\\.(rs|md|toml|go)",
                "[a-z]{1,6}(/[a-z]{1,6}){0,3}/",
                "[a-z]{1,6}(/[a-z]{1,6}){1,3}",
                "[a-z]{1,8}",
                "v[0-9]\\.[0-9]\\.[0-9]",
            ],
            0..20,
        )
    ) {
        let n = named_paths(&words.join(" "));
        let rendered: Vec<String> = n
            .scope_hints
            .iter()
            .map(|d| format!("`{d}/`"))
            .chain(n.files.iter().map(|f| format!("({f}).")))
            .collect();
        prop_assert_eq!(named_paths(&rendered.join(" ")), n.clone());
        let distinct: BTreeSet<&String> = n.files.iter().collect();
        prop_assert_eq!(distinct.len(), n.files.len());
    }

    #[test]
    fn path_key_agrees_with_scope(path in path_strategy()) {
        if let Some(key) = path_key(&path) {
            // Normalized keys are covered by themselves exactly when the
            // scope test accepts the raw path; verbatim keys never are.
            let covered = Scope::from_trusted(vec![key.clone()]).covers_observed(&path);
            let escapes = path.split('/').any(|c| c == "..");
            let names_nothing = !path.starts_with('/')
                && path.split('/').all(|c| c.is_empty() || c == ".");
            prop_assert_eq!(covered, !escapes && !names_nothing);
            prop_assert_eq!(path_key(&key), Some(key));
        } else {
            prop_assert!(path.is_empty());
        }
    }

    #[test]
    fn classify_counts_are_consistent(
        observed in prop::collection::vec(
            (prop_oneof![Just(FactKind::ToolCall), Just(FactKind::Read), Just(FactKind::Mutation)],
             path_strategy()),
            0..30,
        ),
        named_files in prop::collection::vec("[a-z]{1,3}(/[a-z]{1,3})?\\.rs", 0..4),
        has_report in prop::option::of(any::<bool>()),
        downgrades in 0u32..3,
    ) {
        let obs: Vec<ObservedFact> =
            observed.iter().map(|(k, p)| fact(*k, p)).collect();
        let named = NamedPaths { scope_hints: vec![], files: named_files };
        let ws = scope(&["src"]);
        let mut i = input(&named, &ws, &obs);
        i.has_report = has_report;
        i.downgrades = downgrades;
        let a = classify(i);
        let count = |k: FactKind| obs.iter().filter(|f| f.kind == k).count() as u64;
        prop_assert_eq!(a.tool_calls, count(FactKind::ToolCall));
        prop_assert_eq!(a.mutations, count(FactKind::Mutation));
        prop_assert!(a.claim_violations <= a.mutations);
        prop_assert!(a.discovered_paths <= a.evidence_paths);
        prop_assert!(a.mutation_paths.len() as u64 <= a.evidence_paths);
        prop_assert!(a.mutation_paths.windows(2).all(|w| w[0] < w[1]));
        prop_assert_eq!(a.false_completion, has_report == Some(true) && downgrades > 0);
        // Naming every evidence path as a file leaves nothing discovered
        // except paths that cannot be normalized.
        let evidence: BTreeSet<String> = obs
            .iter()
            .filter(|f| f.kind != FactKind::ToolCall)
            .filter_map(|f| path_key(&f.path))
            .collect();
        prop_assert_eq!(a.evidence_paths, evidence.len() as u64);
        let all = NamedPaths { scope_hints: vec![], files: evidence.iter().cloned().collect() };
        let b = classify(input(&all, &ws, &obs));
        let verbatim = evidence
            .iter()
            .filter(|p| !Scope::from_trusted(vec![(*p).clone()]).covers_observed(p))
            .count() as u64;
        prop_assert_eq!(b.discovered_paths, verbatim);
    }

    #[test]
    fn conflicts_are_exact_and_order_free(
        mut by in prop::collection::vec(
            (0u8..5, prop::collection::vec("(src|lib)/[ab]\\.rs", 0..4)),
            0..8,
        )
    ) {
        let c = conflicts(&by);
        for conflict in &c {
            prop_assert!(conflict.contracts.len() >= 2);
            prop_assert!(conflict.contracts.windows(2).all(|w| w[0] < w[1]));
            for k in &conflict.contracts {
                prop_assert!(by.iter().any(|(key, ps)| key == k && ps.contains(&conflict.path)));
            }
        }
        prop_assert!(c.windows(2).all(|w| w[0].path < w[1].path));
        let mut owners: BTreeMap<&String, BTreeSet<u8>> = BTreeMap::new();
        for (k, ps) in &by {
            for p in ps {
                owners.entry(p).or_default().insert(*k);
            }
        }
        let expected = owners.values().filter(|o| o.len() >= 2).count();
        prop_assert_eq!(c.len(), expected);
        by.reverse();
        prop_assert_eq!(conflicts(&by), c);
    }

    #[test]
    fn aggregate_rate_is_ratio_of_sums_within_per_run_bounds(
        pairs in prop::collection::vec((0u64..1_000, 0u64..1_000), 1..20),
        arms in prop::collection::vec(0u8..3, 20),
    ) {
        let runs: Vec<RunTotals> = pairs
            .iter()
            .zip(&arms)
            .map(|(&(a, b), arm)| {
                let (evidence, discovered) = (a.max(b), a.min(b));
                run(&[("arm", &arm.to_string())], discovered, evidence)
            })
            .collect();
        let rows = aggregate(&runs, &["arm".to_owned()]);
        prop_assert_eq!(rows.iter().map(|r| r.runs).sum::<u64>(), runs.len() as u64);
        prop_assert!(rows.windows(2).all(|w| w[0].key < w[1].key));
        for row in &rows {
            let members: Vec<&RunTotals> =
                runs.iter().filter(|r| r.labels["arm"] == row.key["arm"]).collect();
            let num: u64 = members.iter().map(|r| r.sums.discovered).sum();
            let den: u64 = members.iter().map(|r| r.sums.evidence).sum();
            prop_assert_eq!(row.discovery_rate, ratio(num, den));
            let per_run: Vec<f64> =
                members.iter().filter_map(|r| ratio(r.sums.discovered, r.sums.evidence)).collect();
            if let Some(rate) = row.discovery_rate {
                let lo = per_run.iter().copied().fold(f64::INFINITY, f64::min);
                let hi = per_run.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                prop_assert!(lo <= rate && rate <= hi, "{lo} <= {rate} <= {hi}");
            } else {
                prop_assert!(per_run.is_empty());
            }
        }
        let mut shuffled = runs.clone();
        shuffled.reverse();
        prop_assert_eq!(aggregate(&shuffled, &["arm".to_owned()]), rows);
    }
}

#[test]
fn runs_group_by_who_opened_them_under_the_identity_key() {
    let mut a = run(&[("arm", "x")], 1, 4);
    a.orchestrator = "spiffe://prod.test/planner".into();
    let mut b = run(&[("arm", "x")], 1, 2);
    b.orchestrator = "ed25519:00ff".into();
    let mut c = run(&[("arm", "y")], 0, 2);
    c.orchestrator = "spiffe://prod.test/planner".into();
    let by = check_group_by(&[GROUP_BY_IDENTITY.to_owned()], "g").unwrap();
    let groups = aggregate(&[a, b, c], &by);
    let named: Vec<(&str, u64)> = groups
        .iter()
        .map(|g| (g.key[GROUP_BY_IDENTITY].as_str(), g.runs))
        .collect();
    assert_eq!(
        named,
        [("ed25519:00ff", 1), ("spiffe://prod.test/planner", 2)]
    );
    // Only that one key outside the label syntax.
    assert!(check_group_by(&["@other".to_owned()], "g").is_err());
}
