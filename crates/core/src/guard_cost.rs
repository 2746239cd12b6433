//! A static upper bound on the work of evaluating a guard expression (SPEC M5, Z1).
//!
//! CEL always terminates, but not always soon: four nested comprehensions over literal lists
//! of 100 elements are 10^8 iterations in 1.2 KB. The bound here is computed once, when the
//! expression is compiled, by walking its syntax tree; it never looks at a clock, so a guard's
//! result never depends on load and replay (E3) gives the same answer everywhere.
//!
//! The bound is a polynomial in three facts about the data the guard reads:
//! - `L`, the length of the longest list or map anywhere in it;
//! - `W`, its weight: 1 per scalar, list or map, plus 1 per [`STRING_BYTES_PER_UNIT`] bytes
//!   of each string;
//! - `T`, the weight of its longest string.
//!
//! Every syntax node costs at least one step; work that grows with a value (copying,
//! comparing, hashing, searching a string) costs steps per unit of its weight. The step
//! counts are calibrated so that a step takes some 5 to 40 ns. A comprehension costs
//! its body once per element; the body may depend on the element's own weight, and because
//! the weights of all the elements add up to no more than the list's, such terms sum to the
//! list's weight rather than multiply by its length. That is what keeps
//! `payload.items.exists(i, i.text.contains('x'))` linear while a comprehension over run data
//! nested in another is quadratic.
//!
//! The bound is checked twice: when a definition is registered, at the data size of
//! [`limits::GUARD_DATA_REF`] (a guard that cannot handle that much data within
//! [`limits::GUARD_STEPS_MAX`] is refused, naming its bound), and before every evaluation,
//! at the size of the data actually given (a guard over more data than that, or one stored
//! before this rule, fails with a reason instead of running long). Both are pure functions
//! of the expression and the data.

use std::collections::BTreeMap;

use cel::common::ast::{
    ComprehensionExpr, EntryExpr, Expr, IdedEntryExpr, IdedExpr, LiteralValue, operators,
};

use crate::limits;

/// Bytes of a string that count as one unit of weight. Work on string bytes (comparing,
/// searching, copying) is far cheaper per byte than an interpreter step.
pub const STRING_BYTES_PER_UNIT: usize = 8;

/// Symbol of `L`, the longest list or map in the data.
const LONGEST: usize = 0;
/// Symbol of `W`, the weight of the data.
const WEIGHT: usize = 1;
/// Symbol of `T`, the weight of the longest string in the data.
const TEXT: usize = 2;
/// Symbol of the weight of the element a comprehension is at; nested ones count up.
const ELEMENT_0: usize = 3;
/// Steps charged, calibrated against the interpreter (release build): a syntax node is one;
/// starting an iteration of a comprehension (binding its element and accumulator) is
/// [`ITERATION_STEPS`]; a call through the function table ([`CALL_STEPS`]) looks its overload
/// up by name and argument types; a list element or a map entry built by a literal is
/// allocated; copying a value costs [`COPY_STEPS`] per unit of its weight, comparing it
/// [`COMPARE_STEPS`].
const ITERATION_STEPS: u64 = 5;
const CALL_STEPS: u64 = 20;
/// Ordering comparisons, `!` and `-` prepare their error message before they run.
const ORDER_STEPS: u64 = 15;
const LIST_ELEMENT_STEPS: u64 = 2;
const MAP_ENTRY_STEPS: u64 = 10;
const COPY_STEPS: u64 = 8;
const COMPARE_STEPS: u64 = 2;
/// Past this many terms or this degree a bound is taken as unbounded (refused).
const TERMS_MAX: usize = 512;
const DEGREE_MAX: u8 = 16;

/// The variables that carry run data. Iteration variables of the same name shadow them.
const DATA_VARIABLES: [&str; 7] = ["run", "event", "payload", "args", "retry", "def", "budget"];

/// A polynomial with non-negative integer coefficients; saturating, so a bound that
/// overflows stays an upper bound.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Poly {
    /// Exponent of each symbol (trailing zeros trimmed) -> coefficient.
    terms: BTreeMap<Vec<u8>, u64>,
    unbounded: bool,
}

impl Poly {
    fn constant(c: u64) -> Poly {
        let mut p = Poly::default();
        if c > 0 {
            p.terms.insert(Vec::new(), c);
        }
        p
    }

    fn symbol(i: usize) -> Poly {
        let mut exponents = vec![0u8; i + 1];
        exponents[i] = 1;
        let mut p = Poly::default();
        p.terms.insert(exponents, 1);
        p
    }

    fn unbounded() -> Poly {
        Poly {
            terms: BTreeMap::new(),
            unbounded: true,
        }
    }

    fn checked(mut self) -> Poly {
        if self.terms.len() > TERMS_MAX {
            self = Poly::unbounded();
        }
        self
    }

    fn add_term(&mut self, exponents: Vec<u8>, c: u64) {
        if c == 0 {
            return;
        }
        let slot = self.terms.entry(trim(exponents)).or_insert(0);
        *slot = slot.saturating_add(c);
    }

    fn plus(&self, other: &Poly) -> Poly {
        if self.unbounded || other.unbounded {
            return Poly::unbounded();
        }
        let mut out = self.clone();
        for (e, c) in &other.terms {
            out.add_term(e.clone(), *c);
        }
        out.checked()
    }

    fn plus_const(&self, c: u64) -> Poly {
        self.plus(&Poly::constant(c))
    }

    fn scaled(&self, c: u64) -> Poly {
        self.times(&Poly::constant(c))
    }

    fn times(&self, other: &Poly) -> Poly {
        if self.unbounded || other.unbounded {
            return Poly::unbounded();
        }
        let mut out = Poly::default();
        for (a, ca) in &self.terms {
            for (b, cb) in &other.terms {
                let mut e = vec![0u8; a.len().max(b.len())];
                for (i, x) in e.iter_mut().enumerate() {
                    let sum = u16::from(a.get(i).copied().unwrap_or(0))
                        + u16::from(b.get(i).copied().unwrap_or(0));
                    if sum > u16::from(DEGREE_MAX) {
                        return Poly::unbounded();
                    }
                    *x = sum as u8;
                }
                out.add_term(e, ca.saturating_mul(*cb));
            }
            if out.terms.len() > TERMS_MAX {
                return Poly::unbounded();
            }
        }
        out
    }

    fn power(&self, n: u8) -> Poly {
        let mut out = Poly::constant(1);
        for _ in 0..n {
            out = out.times(self);
        }
        out
    }

    /// Coefficient-wise maximum: an upper bound of both, since every symbol is non-negative.
    fn max(&self, other: &Poly) -> Poly {
        if self.unbounded || other.unbounded {
            return Poly::unbounded();
        }
        let mut out = self.clone();
        for (e, c) in &other.terms {
            let slot = out.terms.entry(e.clone()).or_insert(0);
            *slot = (*slot).max(*c);
        }
        out.checked()
    }

    /// The value at `point` (symbols past its end count as 1), saturating.
    fn at(&self, point: &[u64]) -> u64 {
        if self.unbounded {
            return u64::MAX;
        }
        let mut total: u64 = 0;
        for (e, c) in &self.terms {
            let mut term = *c;
            for (i, n) in e.iter().enumerate() {
                let x = point.get(i).copied().unwrap_or(1);
                term = term.saturating_mul(x.saturating_pow(u32::from(*n)));
            }
            total = total.saturating_add(term);
        }
        total
    }

    /// The sum of this polynomial over every element of a comprehension over symbol `k`:
    /// terms without the element's weight count once per element (`count`); a term in
    /// `X_k^e` sums to at most `weight^e`, as the elements' weights add up to the list's.
    /// With a `count` of 1 it is a bound that holds for each element.
    fn summed_over(&self, k: usize, weight: &Poly, count: &Poly) -> Poly {
        if self.unbounded {
            return Poly::unbounded();
        }
        let mut out = Poly::default();
        for (e, c) in &self.terms {
            let n = e.get(k).copied().unwrap_or(0);
            let mut rest = e.clone();
            if let Some(x) = rest.get_mut(k) {
                *x = 0;
            }
            let mut term = Poly::default();
            term.add_term(rest, *c);
            let factor = if n == 0 {
                count.clone()
            } else {
                weight.power(n)
            };
            out = out.plus(&term.times(&factor));
        }
        out
    }
}

fn trim(mut exponents: Vec<u8>) -> Vec<u8> {
    while exponents.last() == Some(&0) {
        exponents.pop();
    }
    exponents
}

/// The point at which two bounds of the same thing are compared, to keep the smaller: data
/// at the reference size, heavier than its longest list, its elements light.
fn comparison_point() -> Vec<u64> {
    let r = limits::GUARD_DATA_REF;
    let mut point = vec![r, 4 * r, r];
    // Each comprehension binds up to three names; each nests one level deeper.
    point.resize(ELEMENT_0 + 3 * limits::GUARD_EXPR_DEPTH_MAX + 3, 2);
    point
}

/// Either bound holds; keeps the one that is smaller at [`comparison_point`].
fn smaller(a: Poly, b: Poly) -> Poly {
    let point = comparison_point();
    if b.at(&point) < a.at(&point) { b } else { a }
}

/// What is known of a value: upper bounds of its weight, of the longest list or map in it and
/// of its longest string.
#[derive(Debug, Clone)]
struct Shape {
    weight: Poly,
    longest: Poly,
    text: Poly,
}

impl Shape {
    fn scalar() -> Shape {
        Shape {
            weight: Poly::constant(1),
            longest: Poly::default(),
            text: Poly::default(),
        }
    }

    fn string(bytes: usize) -> Shape {
        let units = Poly::constant(string_units(bytes));
        Shape {
            weight: units.clone(),
            longest: Poly::default(),
            text: units,
        }
    }

    fn data() -> Shape {
        Shape {
            weight: Poly::symbol(WEIGHT),
            longest: Poly::symbol(LONGEST),
            text: Poly::symbol(TEXT),
        }
    }

    /// An element of a comprehension, of weight `X_k`.
    fn element(k: usize) -> Shape {
        Shape {
            weight: Poly::symbol(k),
            longest: Poly::symbol(k),
            text: Poly::symbol(k),
        }
    }

    /// A value that can be anything up to `weight`.
    fn up_to(weight: Poly) -> Shape {
        Shape {
            longest: weight.clone(),
            text: weight.clone(),
            weight,
        }
    }

    fn unbounded() -> Shape {
        Shape::up_to(Poly::unbounded())
    }

    fn max(&self, other: &Shape) -> Shape {
        Shape {
            weight: self.weight.max(&other.weight),
            longest: self.longest.max(&other.longest),
            text: self.text.max(&other.text),
        }
    }
}

/// An upper bound of the steps an expression takes and of the value it yields.
#[derive(Debug, Clone)]
struct Bound {
    cost: Poly,
    shape: Shape,
}

impl Bound {
    fn leaf(shape: Shape) -> Bound {
        Bound {
            cost: Poly::constant(1),
            shape,
        }
    }

    fn unbounded() -> Bound {
        Bound {
            cost: Poly::unbounded(),
            shape: Shape::unbounded(),
        }
    }
}

/// The bound of a compiled expression: steps as a function of the data it reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuardCost {
    steps: Poly,
}

impl GuardCost {
    /// Bounds `expr` (the parsed CEL program).
    pub(crate) fn of(expr: &IdedExpr) -> GuardCost {
        let mut walker = Walker { scopes: Vec::new() };
        let bound = walker.expr(expr);
        // The result is converted back to a value once.
        GuardCost {
            steps: bound.cost.plus(&bound.shape.weight),
        }
    }

    /// Upper bound of the steps over data of `size`.
    pub fn steps(&self, size: DataSize) -> u64 {
        self.steps.at(&[size.longest, size.weight, size.text])
    }

    /// Whether the bound grows faster than the data (a comprehension over run data nested in
    /// another one).
    pub fn superlinear(&self) -> bool {
        self.steps.unbounded
            || self
                .steps
                .terms
                .keys()
                .any(|e| e.iter().map(|n| u32::from(*n)).sum::<u32>() > 1)
    }
}

/// How a comprehension's accumulator evolves, after the macros of the CEL standard library
/// (the only ones the parser expands).
enum Accumulator<'e> {
    /// `all`, `exists`, `exists_one`: a boolean or a count.
    Scalar,
    /// `map`, `filter`: appends `items` (a list literal) when `guard` holds.
    Append {
        guard: Option<&'e IdedExpr>,
        items: &'e IdedExpr,
    },
}

/// The list literal a `map`/`filter` step appends to the accumulator: `@result + [x]`.
fn appended<'e>(c: &ComprehensionExpr, e: &'e IdedExpr) -> Option<&'e IdedExpr> {
    match &e.expr {
        Expr::Call(call) if call.func_name == operators::ADD && call.target.is_none() => {
            match call.args.as_slice() {
                [lhs, rhs] if is_accu(c, lhs) && matches!(rhs.expr, Expr::List(_)) => Some(rhs),
                _ => None,
            }
        }
        _ => None,
    }
}

fn is_accu(c: &ComprehensionExpr, e: &IdedExpr) -> bool {
    matches!(&e.expr, Expr::Ident(name) if *name == c.accu_var)
}

fn accumulator(c: &ComprehensionExpr) -> Option<Accumulator<'_>> {
    match &c.accu_init.expr {
        Expr::Literal(LiteralValue::Boolean(_) | LiteralValue::Int(_)) => Some(Accumulator::Scalar),
        Expr::List(init)
            if init.elements.is_empty()
                && is_accu(c, &c.result)
                && matches!(c.loop_cond.expr, Expr::Literal(_)) =>
        {
            match &c.loop_step.expr {
                Expr::Call(call)
                    if call.func_name == operators::CONDITIONAL && call.target.is_none() =>
                {
                    match call.args.as_slice() {
                        [guard, step, otherwise] if is_accu(c, otherwise) => {
                            Some(Accumulator::Append {
                                guard: Some(guard),
                                items: appended(c, step)?,
                            })
                        }
                        _ => None,
                    }
                }
                _ => Some(Accumulator::Append {
                    guard: None,
                    items: appended(c, &c.loop_step)?,
                }),
            }
        }
        _ => None,
    }
}

struct Walker {
    /// Names bound by enclosing comprehensions, innermost last.
    scopes: Vec<(String, Shape)>,
}

impl Walker {
    fn lookup(&self, name: &str) -> Shape {
        // A name with a leading dot skips the comprehensions' scopes.
        if let Some((_, shape)) = self.scopes.iter().rev().find(|(n, _)| n == name) {
            return shape.clone();
        }
        let name = name.trim_start_matches('.');
        if DATA_VARIABLES.contains(&name) {
            return Shape::data();
        }
        // A type name or an undeclared name (an error at evaluation).
        Shape::scalar()
    }

    fn expr(&mut self, e: &IdedExpr) -> Bound {
        match &e.expr {
            Expr::Unspecified => Bound::unbounded(),
            Expr::Literal(literal) => Bound::leaf(match literal {
                LiteralValue::String(s) => Shape::string(s.inner().len()),
                LiteralValue::Bytes(b) => Shape::string(b.inner().len()),
                _ => Shape::scalar(),
            }),
            // A name is looked up in every enclosing comprehension's scope, then the root.
            Expr::Ident(name) => Bound {
                cost: Poly::constant(1 + self.scopes.len() as u64),
                shape: self.lookup(name),
            },
            Expr::Select(select) => {
                let operand = self.expr(&select.operand);
                let field = Shape::string(select.field.len()).weight;
                Bound {
                    cost: operand.cost.plus(&field).plus_const(1),
                    shape: if select.test {
                        Shape::scalar()
                    } else {
                        operand.shape
                    },
                }
            }
            Expr::List(list) => {
                let elements: Vec<Bound> = list.elements.iter().map(|x| self.expr(x)).collect();
                collection(&elements, list.elements.len(), LIST_ELEMENT_STEPS)
            }
            Expr::Map(map) => self.entries(&map.entries),
            Expr::Struct(s) => self.entries(&s.entries),
            Expr::Call(call) => {
                let mut args: Vec<Bound> = Vec::with_capacity(call.args.len() + 1);
                if let Some(target) = &call.target {
                    args.push(self.expr(target));
                }
                for a in &call.args {
                    args.push(self.expr(a));
                }
                call_bound(&call.func_name, &args)
            }
            Expr::Comprehension(c) => self.comprehension(c),
        }
    }

    /// A map (or message) literal: each entry's key and value.
    fn entries(&mut self, entries: &[IdedEntryExpr]) -> Bound {
        let mut parts = Vec::new();
        for entry in entries {
            match &entry.expr {
                EntryExpr::MapEntry(m) => {
                    parts.push(self.expr(&m.key));
                    parts.push(self.expr(&m.value));
                }
                EntryExpr::StructField(f) => parts.push(self.expr(&f.value)),
            }
        }
        collection(&parts, entries.len(), MAP_ENTRY_STEPS)
    }

    fn comprehension(&mut self, c: &ComprehensionExpr) -> Bound {
        let Some(kind) = accumulator(c) else {
            return Bound::unbounded();
        };
        let range = self.expr(&c.iter_range);
        let init = self.expr(&c.accu_init);
        let count = smaller(range.shape.weight.clone(), range.shape.longest.clone());
        let k = ELEMENT_0 + self.scopes.len();
        let element = Poly::symbol(k);
        let mut bindings = vec![(c.iter_var.clone(), Shape::element(k))];
        if let Some(second) = &c.iter_var2 {
            bindings.push((second.clone(), Shape::element(k)));
        }
        if matches!(kind, Accumulator::Scalar) {
            bindings.push((c.accu_var.clone(), Shape::scalar()));
        }
        let depth = self.scopes.len();
        self.scopes.extend(bindings);
        // Binding the element copies it; then the loop condition.
        let mut per_element = element
            .scaled(COPY_STEPS)
            .plus_const(ITERATION_STEPS)
            .plus(&self.expr(&c.loop_cond).cost);
        let mut appended = Shape {
            weight: Poly::default(),
            longest: Poly::default(),
            text: Poly::default(),
        };
        let mut appended_len = 0u64;
        match kind {
            Accumulator::Scalar => {
                per_element = per_element.plus(&self.expr(&c.loop_step).cost);
            }
            Accumulator::Append { guard, items } => {
                if let Some(guard) = guard {
                    per_element = per_element.plus(&self.expr(guard).cost);
                }
                if let Expr::List(list) = &items.expr {
                    appended_len = list.elements.len() as u64;
                }
                let items = self.expr(items);
                per_element = per_element
                    .plus(&items.cost)
                    .plus(&items.shape.weight.scaled(COPY_STEPS))
                    .plus_const(1);
                appended = items.shape;
            }
        }
        self.scopes.truncate(depth);
        let total = per_element.summed_over(k, &range.shape.weight, &count);
        let mut cost = range.cost.plus(&init.cost).plus(&total).plus_const(1);
        let shape = match kind {
            Accumulator::Scalar => {
                self.scopes.push((c.accu_var.clone(), Shape::scalar()));
                let result = self.expr(&c.result);
                self.scopes.truncate(depth);
                cost = cost.plus(&result.cost);
                // The result of `all`, `exists` and `exists_one` is a boolean.
                Shape::scalar()
            }
            Accumulator::Append { .. } => {
                cost = cost.plus_const(1);
                // The list of everything appended: as long as the elements times what each
                // appends, its entries no bigger than the largest appended.
                let one = Poly::constant(1);
                Shape {
                    weight: appended
                        .weight
                        .summed_over(k, &range.shape.weight, &count)
                        .plus_const(1),
                    longest: count
                        .scaled(appended_len)
                        .max(&appended.longest.summed_over(k, &range.shape.weight, &one)),
                    text: appended.text.summed_over(k, &range.shape.weight, &one),
                }
            }
        };
        Bound { cost, shape }
    }
}

/// A list or map literal of `len` entries built from `parts`: each entry is allocated
/// (`entry_steps`), each part evaluated and copied in.
fn collection(parts: &[Bound], len: usize, entry_steps: u64) -> Bound {
    let mut cost = Poly::constant(1 + entry_steps.saturating_mul(len as u64));
    let mut weight = Poly::constant(1);
    let mut longest = Poly::constant(len as u64);
    let mut text = Poly::default();
    for p in parts {
        cost = cost.plus(&p.cost).plus(&p.shape.weight.scaled(COPY_STEPS));
        weight = weight.plus(&p.shape.weight);
        longest = longest.max(&p.shape.longest);
        text = text.max(&p.shape.text);
    }
    Bound {
        cost,
        shape: Shape {
            weight,
            longest,
            text,
        },
    }
}

/// The weight of the lighter of two values (either bound holds).
fn lighter(a: &Bound, b: &Bound) -> Poly {
    smaller(a.shape.weight.clone(), b.shape.weight.clone())
}

/// The bound of a call of `name` on `args` (the target first, for a method call).
fn call_bound(name: &str, args: &[Bound]) -> Bound {
    let mut cost = Poly::constant(1);
    for a in args {
        cost = cost.plus(&a.cost);
    }
    let sum = |f: fn(&Shape) -> &Poly| {
        args.iter()
            .fold(Poly::default(), |p, a| p.plus(f(&a.shape)))
    };
    let weights = sum(|s| &s.weight);
    let scalar = |cost: Poly| Bound {
        cost,
        shape: Shape::scalar(),
    };
    match (name, args) {
        (operators::CONDITIONAL, [_, yes, no]) => Bound {
            cost,
            shape: yes.shape.max(&no.shape),
        },
        (
            operators::LOGICAL_AND
            | operators::LOGICAL_OR
            | operators::NOT_STRICTLY_FALSE
            | operators::SUBSTRACT
            | operators::MULTIPLY
            | operators::DIVIDE
            | operators::MODULO,
            _,
        ) => scalar(cost),
        (operators::LOGICAL_NOT | operators::NEGATE, _) => scalar(cost.plus_const(ORDER_STEPS)),
        // Borrows an element, hashing the key: the element is no bigger than its container.
        (operators::INDEX | operators::OPT_INDEX | operators::OPT_SELECT, [container, key]) => {
            Bound {
                cost: cost.plus(&key.shape.weight),
                shape: Shape {
                    weight: container.shape.weight.plus_const(1),
                    longest: container.shape.longest.clone(),
                    text: container.shape.text.clone(),
                },
            }
        }
        // A list is scanned, each element compared with the needle; a map hashes it.
        (operators::IN, [needle, container]) => scalar(
            cost.plus(&needle.shape.weight.scaled(COMPARE_STEPS))
                .plus(&container.shape.weight.scaled(2 * COMPARE_STEPS)),
        ),
        // Concatenation copies both sides.
        (operators::ADD, [_, _]) => Bound {
            cost: cost.plus(&weights.scaled(COPY_STEPS)),
            shape: Shape {
                weight: weights,
                longest: sum(|s| &s.longest),
                text: sum(|s| &s.text),
            },
        },
        // Equal values have equal lengths, checked first: the walk stops at the lighter side.
        (operators::EQUALS | operators::NOT_EQUALS, [a, b]) => {
            scalar(cost.plus(&lighter(a, b).scaled(COMPARE_STEPS)))
        }
        (
            operators::LESS
            | operators::LESS_EQUALS
            | operators::GREATER
            | operators::GREATER_EQUALS,
            [a, b],
        ) => scalar(
            cost.plus(&lighter(a, b).scaled(COMPARE_STEPS))
                .plus_const(ORDER_STEPS),
        ),
        // Counting characters and searching strings walk the strings; the size of a list or
        // a map is known.
        ("size" | "contains" | "startsWith" | "endsWith" | "matches", _) => {
            scalar(cost.plus(&sum(|s| &s.text)).plus_const(CALL_STEPS))
        }
        // Conversions (`string`, `int`, ...), optional values and anything else: the work
        // and the result grow with the arguments at most; a number printed as a string takes
        // a few units.
        _ => Bound {
            cost: cost
                .plus(&weights.scaled(COPY_STEPS))
                .plus_const(CALL_STEPS),
            shape: Shape {
                text: weights.plus_const(4),
                longest: sum(|s| &s.longest),
                weight: weights.plus_const(4),
            },
        },
    }
}

fn string_units(bytes: usize) -> u64 {
    1 + bytes.div_ceil(STRING_BYTES_PER_UNIT) as u64
}

/// Three facts about data, as the bound counts them: its longest list or map, its weight and
/// the weight of its longest string.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DataSize {
    pub longest: u64,
    pub weight: u64,
    pub text: u64,
}

impl DataSize {
    pub fn of(value: &serde_json::Value) -> DataSize {
        let mut size = DataSize::default();
        size.weight = measure(value, &mut size);
        size
    }

    /// The data a guard must handle when its definition is registered.
    pub fn reference() -> DataSize {
        DataSize {
            longest: limits::GUARD_DATA_REF,
            weight: limits::GUARD_DATA_REF,
            text: limits::GUARD_DATA_REF,
        }
    }

    /// The larger of each fact: a bound that holds for each of two values holds for this.
    pub fn max(self, other: DataSize) -> DataSize {
        DataSize {
            longest: self.longest.max(other.longest),
            weight: self.weight.max(other.weight),
            text: self.text.max(other.text),
        }
    }
}

/// The weight of `value`, recording its longest list or map and longest string in `size`.
fn measure(value: &serde_json::Value, size: &mut DataSize) -> u64 {
    use serde_json::Value as J;
    let string = |s: &str, size: &mut DataSize| {
        let units = string_units(s.len());
        size.text = size.text.max(units);
        units
    };
    match value {
        J::Null | J::Bool(_) | J::Number(_) => 1,
        J::String(s) => string(s, size),
        J::Array(items) => {
            size.longest = size.longest.max(items.len() as u64);
            items
                .iter()
                .fold(1u64, |w, x| w.saturating_add(measure(x, size)))
        }
        J::Object(map) => {
            size.longest = size.longest.max(map.len() as u64);
            map.iter().fold(1u64, |w, (k, x)| {
                let key = string(k, size);
                w.saturating_add(key).saturating_add(measure(x, size))
            })
        }
    }
}
