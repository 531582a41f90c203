/**
 * The success path of a single-row update of plain values, planned once per
 * shape. The key and the patch are checked as for every write (table.ts:
 * each value read once, every refusal before any query); then, for each
 * table, fence comparison, `returning` and claim mode, the patch's column
 * keys — in the order the patch lists them — lead through a trie to the
 * plan of that shape: its plain write's cache key and text. A write of a
 * planned shape fills the values of that statement and sends it; the
 * statement objects and closures of statements.ts are built only for a
 * shape's first write, for a patch with an SQL value, or when the write is
 * refused. Plans belong to the table object, so a repository made for each
 * transaction finds them.
 */
import type { SQL } from 'drizzle-orm';
import type { Fence } from '../fencing/fence.js';
import { type Claim, claimValues } from './claim-guard.js';
import type { ClaimMode } from './statement-keys.js';
import {
  type FencedWrite,
  keyPlaceholder,
  plainUpdateStatement,
  type Returning,
  type SameFence,
  type Statement,
  updateStatements,
  valuePlaceholder,
} from './statements.js';
import { isSql, type TableInfo } from './table.js';

/** @internal The plan of one shape: its plain write's cache key and text. */
export interface UpdatePlan {
  readonly key: string;
  readonly build: () => SQL;
}

type Entries = readonly (readonly [string, unknown])[];

interface Node {
  next: Map<string, Node> | undefined;
  plan: UpdatePlan | undefined;
}

const MODES: readonly ClaimMode[] = ['none', 'claim', 'shared'];
// By table, not by repository: a repository made for each transaction finds the plans of the last.
const roots = new WeakMap<TableInfo['table'], Node[]>();

function root(info: TableInfo, same: SameFence, returning: Returning, mode: ClaimMode): Node {
  let variants = roots.get(info.table);
  if (variants === undefined) {
    variants = [];
    roots.set(info.table, variants);
  }
  const v = (same === 'allow' ? 6 : 0) + (returning === 'row' ? 3 : 0) + MODES.indexOf(mode);
  let node = variants[v];
  if (node === undefined) {
    node = { next: undefined, plan: undefined };
    variants[v] = node;
  }
  return node;
}

/**
 * @internal What the trie knows of the update of `patch` (its entries, as
 * the full path checked them): the plan of its shape; `unplanned` for a
 * shape of plain values not planned yet; `undefined` when a value is SQL
 * (those shapes take the full path: see expressions.ts).
 */
export function findPlan(
  info: TableInfo,
  same: SameFence,
  returning: Returning,
  mode: ClaimMode,
  patch: Entries,
): UpdatePlan | 'unplanned' | undefined {
  let node: Node | undefined = root(info, same, returning, mode);
  for (const [name, value] of patch) {
    if (typeof value === 'object' && value !== null && isSql(value)) return undefined;
    node = node?.next?.get(name);
  }
  return node?.plan ?? 'unplanned';
}

/**
 * @internal Plans the shape of an update the full path has just checked:
 * `patch`, the column keys it sets to plain values, in order.
 */
export function learnPlan(
  info: TableInfo,
  same: SameFence,
  returning: Returning,
  mode: ClaimMode,
  patch: readonly string[],
): void {
  let node = root(info, same, returning, mode);
  for (const name of patch) {
    node.next ??= new Map();
    let next = node.next.get(name);
    if (next === undefined) {
      next = { next: undefined, plan: undefined };
      node.next.set(name, next);
    }
    node = next;
  }
  if (node.plan !== undefined) return;
  const { key, build } = plainUpdateStatement(info, patch, same, returning, mode);
  if (key !== undefined) node.plan = { key, build };
}

/**
 * @internal A write of a planned shape as the {@link FencedWrite} the
 * repository runs: its plain write from the plan, with this write's values;
 * its refusal statement built — by the full path, from the same entries —
 * only when the refusal path asks for it.
 */
export class PlannedWrite implements FencedWrite {
  readonly method = 'update';
  readonly write: Statement;
  #full: FencedWrite | undefined;

  constructor(
    private readonly info: TableInfo,
    plan: UpdatePlan,
    private readonly same: SameFence,
    readonly key: Entries,
    private readonly patch: Entries,
    private readonly fence: Fence,
    readonly returning: Returning,
    readonly claim: Claim | undefined,
  ) {
    const values: Record<string, unknown> = { fence };
    for (let i = 0; i < key.length; i++) values[keyPlaceholder(i)] = (key[i] as Entries[number])[1];
    for (let i = 0; i < patch.length; i++) values[valuePlaceholder(i)] = (patch[i] as Entries[number])[1];
    if (claim) claimValues(values, claim);
    this.write = { key: plan.key, build: plan.build, values };
  }

  get refusal(): Statement {
    this.#full ??= updateStatements(this.info, this.key, this.patch, this.fence, this.same, this.returning, this.claim);
    return this.#full.refusal;
  }
}
