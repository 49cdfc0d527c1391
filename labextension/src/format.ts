/** How numbers read in the panel and the run view. */

/** `value` with `digits` significant digits (an exponent below 1e-3 and from 1e6), or an en dash. */
export function sig(value: number | null | undefined, digits = 4): string {
  if (value === null || value === undefined || !Number.isFinite(value)) {
    return '–';
  }
  const a = Math.abs(value);
  const exponent = a !== 0 && (a < 1e-3 || a >= 1e6);
  return exponent ? value.toExponential(digits - 1) : String(Number(value.toPrecision(digits)));
}

/** `seconds` as 12.3 s, 4:05 or 1:02:03, or an en dash. */
export function duration(seconds: number | null): string {
  if (seconds === null || !Number.isFinite(seconds)) {
    return '–';
  }
  if (seconds < 60) {
    return `${seconds.toFixed(1)} s`;
  }
  const s = Math.round(seconds);
  const mm = `${Math.floor((s % 3600) / 60)}`.padStart(s >= 3600 ? 2 : 1, '0');
  const ss = `${s % 60}`.padStart(2, '0');
  return s >= 3600 ? `${Math.floor(s / 3600)}:${mm}:${ss}` : `${mm}:${ss}`;
}

/** `value` as a person writes a setting: a whole number in full (steps=1000000), others with 4 significant digits. */
export function setting(value: number): string {
  return Number.isSafeInteger(value) ? String(value) : sig(value);
}

/** A run's hyperparameters as `key=value` words (numbers by `setting`). */
export function settings(hyperparameters: Record<string, string | number | boolean>): string {
  return Object.entries(hyperparameters)
    .map(([k, v]) => `${k}=${typeof v === 'number' ? setting(v) : v}`)
    .join(' ');
}

/** A run's final metrics as `name value` words, each with `digits` significant digits. */
export function finals(final: Record<string, number | null>, digits = 4): string[] {
  return Object.entries(final).map(([name, value]) => `${name} ${sig(value, digits)}`);
}
