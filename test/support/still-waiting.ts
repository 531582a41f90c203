/**
 * How a test tells "ended at once" (on an abort, at the wait's end) from
 * "held until something else answered" without timing the call: its
 * outcome, or a marker string if it has not settled long after (bounded,
 * so a regression fails the test instead of hanging it).
 */

/** What `call` settled with (its value, or what it rejected with), or `still waiting after …` past `ms`. */
export async function outcomeOrStillWaiting(call: Promise<unknown>, ms = 20_000): Promise<unknown> {
  let cap: NodeJS.Timeout | undefined;
  return Promise.race([
    call.then(
      (value) => value,
      (err: unknown) => err,
    ),
    new Promise((resolve) => {
      cap = setTimeout(() => resolve(`still waiting after ${ms / 1000} s`), ms);
    }),
  ]).finally(() => clearTimeout(cap));
}
