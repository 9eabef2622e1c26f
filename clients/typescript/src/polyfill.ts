// `Symbol.asyncDispose` for runtimes that lack it (Node 18 before 18.18), so `await using`
// (compiled by TypeScript >= 5.2) and Lease's [Symbol.asyncDispose] agree on one symbol.
if (typeof (Symbol as { asyncDispose?: symbol }).asyncDispose !== "symbol") {
  Object.defineProperty(Symbol, "asyncDispose", {
    value: Symbol.for("Symbol.asyncDispose"),
    writable: false,
    enumerable: false,
    configurable: false,
  });
}
export {};
