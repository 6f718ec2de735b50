//! The split of a predicate into its top-level conjuncts, each with its
//! source text, and the shape issuance checks (`conjunct_shape`).

use cel::Program;
use cel::common::ast::{CallExpr, EntryExpr, Expr, IdedEntryExpr, IdedExpr, operators};

/// What issuance needs to know of a predicate to vouch that it can be
/// judged: its syntax tree's depth and how many top-level conjuncts the
/// judge will split it into.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    pub depth: usize,
    pub conjuncts: usize,
}

/// Parses `text` as the judge does and measures it.
pub(crate) fn conjunct_shape(text: &str) -> Result<Shape, String> {
    let program = Program::compile(text).map_err(|e| format!("does not parse as CEL: {e}"))?;
    let root = program.expression();
    let (depth, _) = depth_and_max_id(root);
    let (conjuncts, _) = split_conjuncts(root, &program);
    Ok(Shape {
        depth,
        conjuncts: conjuncts.len(),
    })
}

/// The direct sub-expressions of `e`.
pub(super) fn children(e: &Expr) -> Vec<&IdedExpr> {
    fn entry_exprs(entries: &[IdedEntryExpr]) -> Vec<&IdedExpr> {
        entries
            .iter()
            .flat_map(|en| match &en.expr {
                EntryExpr::MapEntry(m) => vec![&m.key, &m.value],
                EntryExpr::StructField(f) => vec![&f.value],
            })
            .collect()
    }
    match e {
        Expr::Call(c) => c.target.iter().map(|t| &**t).chain(&c.args).collect(),
        Expr::Comprehension(c) => vec![
            &c.iter_range,
            &c.accu_init,
            &c.loop_cond,
            &c.loop_step,
            &c.result,
        ],
        Expr::List(l) => l.elements.iter().collect(),
        Expr::Map(m) => entry_exprs(&m.entries),
        Expr::Struct(s) => entry_exprs(&s.entries),
        Expr::Select(s) => vec![&*s.operand],
        Expr::Ident(_) | Expr::Literal(_) | Expr::Unspecified => Vec::new(),
    }
}

/// Depth of the tree and its largest node id, without recursion.
pub(super) fn depth_and_max_id(root: &IdedExpr) -> (usize, u64) {
    let (mut depth, mut max_id) = (0, 0);
    let mut stack = vec![(root, 1usize)];
    while let Some((e, d)) = stack.pop() {
        depth = depth.max(d);
        max_id = max_id.max(e.id);
        stack.extend(children(&e.expr).into_iter().map(|c| (c, d + 1)));
    }
    (depth, max_id)
}

fn is_and(e: &Expr) -> Option<&CallExpr> {
    match e {
        Expr::Call(c) if c.func_name == operators::LOGICAL_AND && c.target.is_none() => {
            (c.args.len() == 2).then_some(c)
        }
        _ => None,
    }
}

/// The top-level conjuncts, left to right (parentheses leave no node, so
/// walking `&&` walks through them), and the source offsets of the `&&`
/// operators that join them.
pub(super) fn split_conjuncts<'e>(
    root: &'e IdedExpr,
    program: &Program,
) -> (Vec<&'e IdedExpr>, Vec<u32>) {
    let (mut conjuncts, mut offsets) = (Vec::new(), Vec::new());
    let mut stack = vec![root];
    while let Some(e) = stack.pop() {
        match is_and(&e.expr) {
            Some(call) => {
                if let Some((start, _)) = program.source_info().offset_for(e.id) {
                    offsets.push(start);
                }
                stack.push(&call.args[1]);
                stack.push(&call.args[0]);
            }
            None => conjuncts.push(e),
        }
    }
    offsets.sort_unstable();
    (conjuncts, offsets)
}

/// Each conjunct's source text: the text between the `&&` operators that
/// separate it from its neighbours, without the parentheses around it.
/// Falls back to a positional name if the offsets do not point at `&&`.
pub(super) fn conjunct_texts(source: &str, and_offsets: &[u32], count: usize) -> Vec<String> {
    let ops: Option<Vec<usize>> = and_offsets
        .iter()
        .map(|&o| {
            let o = o as usize;
            (source.get(o..o + 2) == Some("&&")).then_some(o)
        })
        .collect();
    match ops {
        Some(ops) if ops.len() + 1 == count => {
            let mut bounds = vec![0];
            for o in &ops {
                bounds.push(*o);
                bounds.push(o + 2);
            }
            bounds.push(source.len());
            bounds
                .chunks(2)
                .map(|b| strip_parens(&source[b[0]..b[1]]).to_owned())
                .collect()
        }
        _ => (1..=count)
            .map(|i| format!("conjunct {i} of {count}"))
            .collect(),
    }
}

/// Removes whitespace, unmatched parentheses at the ends (left over from
/// splitting `(a && b) && c` at its operators) and parentheses that enclose
/// the whole text.
pub(super) fn strip_parens(text: &str) -> &str {
    let mut s = text.trim();
    loop {
        let pairs = match_parens(s);
        let last = s.len().wrapping_sub(1);
        let next = if s.starts_with('(') && pairs.first_open.is_none_or(|close| close == last) {
            let inner = &s[1..];
            if pairs.first_open == Some(last) {
                &inner[..inner.len() - 1]
            } else {
                inner
            }
        } else if s.ends_with(')') && pairs.last_close_unmatched {
            &s[..last]
        } else {
            return s;
        };
        s = next.trim();
    }
}

struct Parens {
    /// Where the parenthesis opening at byte 0 closes, if it does.
    first_open: Option<usize>,
    /// The final `)` closes nothing within the text.
    last_close_unmatched: bool,
}

/// Matches parentheses outside CEL string literals and comments.
fn match_parens(s: &str) -> Parens {
    let mut stack: Vec<usize> = Vec::new();
    let mut result = Parens {
        first_open: None,
        last_close_unmatched: false,
    };
    for (i, c) in crate::predicate::code_bytes(s) {
        match c {
            b'(' => stack.push(i),
            b')' => match stack.pop() {
                Some(0) => result.first_open = Some(i),
                Some(_) => {}
                None => result.last_close_unmatched = i + 1 == s.len(),
            },
            _ => {}
        }
    }
    result
}
