{{/* The chart name, shortened to 63 characters. */}}
{{- define "overlap.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The full name: release-chart, unless the release name already contains the chart name. */}}
{{- define "overlap.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "overlap.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "overlap.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: overlap
{{- end }}

{{- define "overlap.selectorLabels" -}}
app.kubernetes.io/name: {{ include "overlap.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "overlap.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "overlap.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "overlap.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The operator's permissions: only the resources and verbs it uses (see operator/src/overlap/operator/kube.py, operator/src/overlap/operator/handlers.py). */}}
{{- define "overlap.rules" -}}
- apiGroups: [overlap.dev]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch]
- apiGroups: [overlap.dev]
  resources: [inferenceservices/status]
  verbs: [patch]
# Owner references with blockOwnerDeletion need it where the OwnerReferencesPermissionEnforcement plugin is on.
- apiGroups: [overlap.dev]
  resources: [inferenceservices/finalizers]
  verbs: [update]
# delete: the scale-to-zero activator's Deployment and Service go when a service no longer scales to zero.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch, delete]
# delete: a service's NAME-adapters ConfigMap goes when spec.adapters lists none.
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, watch, create, patch, delete]
# Secrets: create cannot be scoped by name, but reads and writes are: the operator can read no Secret but its own.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
- apiGroups: [""]
  resources: [secrets]
  resourceNames: [overlap-admin-tokens]
  verbs: [get, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
# A fetching pod's last log line (its progress) for the ModelReady condition.
- apiGroups: [""]
  resources: [pods/log]
  verbs: [get]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch]
# Children are server-side applied (patch; create when the apply makes one); a disabled ServiceMonitor is deleted.
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}
