import { fc, test } from '@fast-check/vitest';
import { describe, expect, it } from 'vitest';
import { InvalidArgumentError } from '../src/errors.js';
import { assertFence, isFence, MAX_FENCE, toFence } from '../src/fencing/fence.js';

describe('toFence', () => {
  it('accepts a bigint, a safe integer number and a canonical decimal string', () => {
    expect(toFence(1n)).toBe(1n);
    expect(toFence(42)).toBe(42n);
    expect(toFence(Number.MAX_SAFE_INTEGER)).toBe(2n ** 53n - 1n);
    expect(toFence('7')).toBe(7n);
    expect(toFence(2n ** 53n + 1n)).toBe(9007199254740993n);
    expect(toFence('9007199254740993')).toBe(2n ** 53n + 1n);
    expect(toFence(2n ** 63n - 1n)).toBe(MAX_FENCE);
    expect(toFence('9223372036854775807')).toBe(MAX_FENCE);
  });

  const refused: [string, unknown][] = [
    ['0', 0],
    ['0n', 0n],
    ['-0', -0],
    ['-1', -1],
    ['-1n', -1n],
    ['1.5', 1.5],
    ['NaN', Number.NaN],
    ['Infinity', Number.POSITIVE_INFINITY],
    ['-Infinity', Number.NEGATIVE_INFINITY],
    ['2^53+1 as a number (already rounded)', 2 ** 53 + 1],
    ['2^63', 2n ** 63n],
    ["'9223372036854775808' (2^63)", '9223372036854775808'],
    ["'99999999999999999999'", '99999999999999999999'],
    ["'0'", '0'],
    ["'-5'", '-5'],
    ["'+5'", '+5'],
    ["' 5'", ' 5'],
    ["'5 '", '5 '],
    ["'5\\n'", '5\n'],
    ["'0x10'", '0x10'],
    ["'1e3'", '1e3'],
    ["'05'", '05'],
    ["'1.0'", '1.0'],
    ["''", ''],
    ['an object', { fence: 5n }],
    ['a boxed bigint', Object(5n)],
    ['an array', [5]],
    ['null', null],
    ['undefined', undefined],
    ['a boolean', true],
  ];

  it.each(refused)('refuses %s with InvalidArgumentError', (_, value) => {
    expect(() => toFence(value)).toThrow(InvalidArgumentError);
    expect(() => toFence(value)).toThrow(expect.objectContaining({ code: 'invalid_argument' }));
  });

  test.prop([fc.bigInt({ min: 1n, max: MAX_FENCE })])('round-trips every fence through its decimal string', (n) => {
    expect(toFence(n.toString())).toBe(n);
    expect(toFence(n)).toBe(n);
  });
});

describe('assertFence and isFence', () => {
  it('take only bigints in 1 … 2^63−1 (no strings or numbers at a typed boundary)', () => {
    expect(isFence(1n)).toBe(true);
    expect(isFence(MAX_FENCE)).toBe(true);
    for (const value of [0n, MAX_FENCE + 1n, -1n, 5, '5', null]) {
      expect(isFence(value)).toBe(false);
      expect(() => assertFence(value)).toThrow(InvalidArgumentError);
    }
    expect(assertFence(5n)).toBe(5n);
  });
});
