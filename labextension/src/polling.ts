// A widget that refreshes itself every `interval` ms while it is visible, and not at all while hidden.

import { Poll } from '@lumino/polling';
import { Widget } from '@lumino/widgets';

export const REFRESH_MS = 1500;

export abstract class PollingWidget extends Widget {
  constructor(interval = REFRESH_MS) {
    super();
    this.poll = new Poll({
      factory: () => this.refresh(),
      frequency: { interval, backoff: false },
      standby: () => !this.isVisible || 'when-hidden'
    });
  }

  /** Fetch from the server and redraw; called by the poll. */
  abstract refresh(): Promise<void>;

  dispose(): void {
    this.poll.dispose();
    super.dispose();
  }

  protected onAfterShow(): void {
    void this.poll.refresh();
  }

  protected readonly poll: Poll;
}
