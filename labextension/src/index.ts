/** pscluster's JupyterLab plugin: the side panel, and main-area views of a run or of runs compared, opened from it. */
import { ILabShell, ILayoutRestorer, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { MainAreaWidget } from '@jupyterlab/apputils';
import { LabIcon } from '@jupyterlab/ui-components';

import { RunInfo, runKey } from './api';
import { ClusterPanel } from './panel';
import { RunView } from './runview';

const icon = new LabIcon({
  name: 'pscluster:icon',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24"><g class="jp-icon3" fill="#616161">' +
    '<rect x="9" y="2" width="6" height="6" rx="1"/><rect x="2" y="16" width="6" height="6" rx="1"/>' +
    '<rect x="16" y="16" width="6" height="6" rx="1"/><path d="M11.5 8h1v4h6.5v4h-1v-3h-12v3h-1v-4h6.5z"/></g></svg>'
});

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'pscluster:panel',
  description: 'Clusters and runs of pscluster in the left side panel',
  autoStart: true,
  requires: [ILabShell],
  optional: [ILayoutRestorer],
  activate: (app: JupyterFrontEnd, shell: ILabShell, restorer: ILayoutRestorer | null) => {
    const views = new Map<string, MainAreaWidget<RunView>>();
    let opened = 0;
    const openRuns = (runs: RunInfo[]) => {
      const key = runs.map(runKey).join('\n\n');
      let view = views.get(key);
      if (!view || view.isDisposed) {
        view = new MainAreaWidget({ content: new RunView(runs) });
        view.id = `pscluster-run-${++opened}`;
        view.title.label = runs.length === 1 ? runs[0].name : `compare ${runs.map(r => r.name).join(', ')}`;
        view.title.icon = icon;
        view.title.closable = true;
        views.set(key, view);
        shell.add(view, 'main');
      }
      shell.activateById(view.id);
    };
    const panel = new ClusterPanel(openRuns);
    panel.title.icon = icon;
    shell.add(panel, 'left', { rank: 600 });
    restorer?.add(panel, panel.id);
  }
};

export default plugin;
